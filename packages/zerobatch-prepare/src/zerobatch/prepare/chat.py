"""Chat data: conversations (``{"messages": [{"role": ..., "content": ...}, ...]}``, the layout
Hugging Face and OpenAI use) rendered with the tokenizer's own chat template and tokenized,
one document per conversation, with a per-token loss mask.

The template is the one in the tokenizer folder (``tokenizer_config.json``'s ``chat_template``,
or ``chat_template.jinja``), rendered with Jinja2 in a sandbox as ``transformers`` renders it
(``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``tojson``, the tokenizer's special
tokens as variables), and the text is tokenized with the folder's ``tokenizer.json`` with the
special tokens the template writes recognised (as ``apply_chat_template(tokenize=True)``), so the
ids are the ones ``transformers`` gives, token for token.

The loss mask is 1 on the tokens of the messages whose role is in ``roles`` (assistant only by
default) and 0 elsewhere, as ``transformers``' ``apply_chat_template(...,
return_assistant_tokens_mask=True, return_dict=True)`` makes its assistant mask:

* A template with ``{% generation %}...{% endgeneration %}`` marks says itself which text is an
  assistant's: the assistant tokens are the text inside the marks, exactly (a role header or a
  newline the template writes outside them is not trained on, one inside them is).
* A template without marks (and, with marks, any other role in ``roles``, such as ``tool``):
  the text of message ``i`` is what the rendering of messages ``0..i`` adds to that of
  ``0..i-1``, less the role header the template writes before the message's content (for an
  assistant message, the generation prompt, when the template writes one; otherwise what the
  rendering of the message with two different contents has in common). Templates that do not
  render conversations append-only (a later message changing the text of an earlier one) are
  refused by name.

Either way a token is trained on when any character of it is in that text (``transformers``'
rule: a token that straddles a mark, such as a ``\n\n`` made of the header's newline and the
first one of a reply, is trained on).

Messages are handed to the template as ``transformers`` hands them: keys whose value is null
dropped, ``reasoning``/``thinking`` copied to ``reasoning_content``, and a ``content`` that is
a list of parts (OpenAI's ``[{"type": "text", "text": ...}, {"type": "image_url", ...}]``)
passed as it is, for templates that iterate over parts. A conversation the template cannot
render is a :class:`~zerobatch.formats.errors.CorruptError` naming it and the message.

The mask is stored as a second TOKSTREAM dataset beside the tokens, ``DST/loss_mask/``, with
the same documents and shards (one ``uint16`` 0/1 per token: half the bytes of per-token
metadata ids, and read with the same compiled gathers as the tokens);
:func:`zerobatch.readers.tokstream.open_loss_mask` opens it and checks that it matches.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any, TypedDict

import numpy as np

from zerobatch.formats.errors import ConfigError, CorruptError, NotFoundError

__all__ = ["ChatTemplate"]
#: The roles whose tokens are trained on unless told otherwise.
DEFAULT_ROLES = ("assistant",)
#: The version of the rule that makes the loss mask (part of :attr:`ChatTemplate.fingerprint`, so
#: a distributed conversion is not resumed across a change of it). 2: the ``{% generation %}``
#: marks followed, tokens straddling a boundary trained on, role headers never trained on.
MASK_RULE = 2


class _Tracking(TypedDict):
    """What a rendering that tracks the ``{% generation %}`` marks has seen so far."""

    length: int                         # characters rendered so far
    spans: list[tuple[int, int]]        # each mark's span of the text, in characters


class ChatTemplate:
    """A tokenizer folder's chat template and tokenizer.

    Args:
        folder: a Hugging Face tokenizer folder (``tokenizer.json`` and ``tokenizer_config.json``
            with a ``chat_template``, or ``chat_template.jinja``).
        roles: the roles whose tokens the loss mask keeps.

    Raises:
        NotFoundError: no tokenizer or no chat template in the folder.
        ConfigError: jinja2 or tokenizers missing; a template that does not parse.
    """

    def __init__(self, folder: str | os.PathLike[str], roles: Sequence[str] = DEFAULT_ROLES) -> None:
        folder = os.fspath(folder)
        if os.path.isfile(folder):
            folder = os.path.dirname(folder) or "."
        self.folder = folder
        self.roles = tuple(roles)
        if not self.roles or not all(isinstance(r, str) and r for r in self.roles):
            raise ConfigError("--chat-roles: name at least one role (assistant, tool, ...)", field="chat_roles")
        config, template = _read_template(folder)
        self.specials = {k: _token_text(v) for k, v in config.items()
                         if k.endswith("_token") and _token_text(v) is not None}
        try:
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ConfigError("--chat needs jinja2: pip install 'zerobatch-prepare[chat]'", field="chat") from None

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        owner = self
        #: the template has ``{% generation %}`` marks (set while it is parsed)
        self.marks = False
        #: while a rendering tracks the marks: the characters rendered so far and the marks' spans
        self._tracking: _Tracking | None = None

        class Generation(jinja2.ext.Extension):
            """``{% generation %}...{% endgeneration %}`` (transformers' marks of assistant
            text): rendered as its body; while a rendering tracks them, each one's span of
            the text is recorded as ``transformers``' ``AssistantTracker`` records it (from
            the length of what the template has yielded so far)."""

            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                owner.marks = True
                return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

            def _generation(self, caller: Any) -> str:
                text = caller()
                tracking = owner._tracking
                if tracking is not None:
                    start = tracking["length"]
                    tracking["spans"].append((start, start + len(text)))
                return text

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols", Generation])
        env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, ensure_ascii=False: \
            json.dumps(x, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(template)
        except jinja2.exceptions.TemplateError as exc:
            raise ConfigError(f"chat template: does not parse ({exc})", path=folder, field="chat_template") from None
        self._errors = jinja2.exceptions.TemplateError
        tok_path = os.path.join(folder, "tokenizer.json")
        if not os.path.exists(tok_path):
            raise NotFoundError("tokenizer.json: the chat template's tokenizer is missing", path=tok_path,
                                field="tokenizer.json")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("--chat needs tokenizers: pip install tokenizers", field="chat") from None
        self.tokenizer = Tokenizer.from_file(tok_path)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        digest = hashlib.sha256(json.dumps([template, self.specials, self.roles, MASK_RULE]).encode("utf-8"))
        digest.update(self.tokenizer.to_str().encode("utf-8"))
        #: what decides the ids and masks: the template, special tokens, roles, tokenizer and mask rule
        self.fingerprint = digest.hexdigest()[:32]

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The text of ``messages`` (as ``apply_chat_template(..., tokenize=False)``).

        Raises:
            CorruptError: the template cannot render them (``raise_exception``, or a message it
                was not written for, such as a list of parts where it concatenates strings).
        """
        return self._render(_template_messages(messages), add_generation_prompt, "conversation")

    def _render_raw(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                    spans: list[tuple[int, int]] | None = None) -> str:
        """The rendering, as ``transformers`` calls the template (``tools`` and ``documents``
        None, the special tokens as variables); with ``spans``, the marks' spans of the text
        appended to it (the template's output collected piece by piece, as transformers'
        ``_render_with_assistant_indices``)."""
        kwargs = {"messages": messages, "tools": None, "documents": None,
                  "add_generation_prompt": add_generation_prompt, **self.specials}
        if spans is None:
            return self.template.render(**kwargs)
        pieces: list[str] = []
        self._tracking = tracking = _Tracking(length=0, spans=spans)
        try:
            for piece in self.template.generate(**kwargs):
                pieces.append(piece)
                tracking["length"] += len(piece)
        finally:
            self._tracking = None
        return "".join(pieces)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, where: str,
                spans: list[tuple[int, int]] | None = None) -> str:
        """:meth:`_render_raw`, a failure named by conversation and message."""
        try:
            return self._render_raw(messages, add_generation_prompt, spans)
        except Exception as exc:  # the template's own errors, and any Python error in its expressions
            raise self._render_error(messages, where, exc) from None

    def _render_error(self, messages: list[dict[str, Any]], where: str, exc: Exception) -> CorruptError:
        """The error of a conversation the template cannot render: the message named is the
        first whose addition makes the rendering fail."""
        failing = len(messages) - 1
        for k in range(1, len(messages)):
            try:
                self._render_raw(messages[:k])
            except Exception:  # the first prefix the template cannot render either
                failing = k - 1
                break
        what = f"{type(exc).__name__}: {exc}" if not isinstance(exc, self._errors) else str(exc)
        hint = ""
        if 0 <= failing < len(messages) and isinstance(messages[failing].get("content"), list):
            hint = "; its content is a list of parts, and this chat template may take only a string"
        label = f"message {failing}" if failing >= 0 else "no message"
        return CorruptError(f"{where}: {label}: the chat template cannot render it ({what}){hint}",
                            field=f"messages[{failing}]" if failing >= 0 else "messages")

    def encode(self, messages: Any, *, where: str = "conversation") -> tuple[np.ndarray, np.ndarray]:
        """``(ids, loss mask)`` of one conversation: the ids and assistant mask of
        ``transformers``' ``apply_chat_template(messages, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True)`` on a template with ``{% generation %}`` marks
        (see the module documentation for the rest).

        Args:
            messages: a list of ``{"role": str, "content": ...}``.
            where: names the conversation in errors (``"chat.jsonl line 7"``).

        Raises:
            CorruptError: ``messages`` is not a list of ``{"role": str, "content": ...}``; the
                template cannot render it; a lone UTF-16 surrogate in its text.
            ConfigError: the template does not render conversations append-only (templates
                without marks, or roles besides assistant).
        """
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                     for m in messages):
            raise CorruptError(f"{where}: messages must be a list of {{'role': ..., 'content': ...}}", field="messages")
        messages = _template_messages(messages)
        spans: list[tuple[int, int]] = []
        if self.marks and "assistant" in self.roles:
            full = self._render(messages, False, where, spans)
            by_text = tuple(r for r in self.roles if r != "assistant")
        else:
            full = self._render(messages, False, where)
            by_text = self.roles
        if any(m["role"] in by_text for m in messages):
            spans = sorted(spans + self._text_spans(messages, full, by_text, where))
        try:
            enc = self.tokenizer.encode(full, add_special_tokens=False)
        except Exception as exc:  # tokenizers raises TypeError for text it cannot take (lone surrogates)
            bad = next((i for i, m in enumerate(messages) if _has_surrogates(m)), None)
            if bad is not None:
                raise CorruptError(f"{where}: message {bad}: holds a lone UTF-16 surrogate (an escape such as "
                                   f"\\ud83d without its pair), which no tokenizer takes",
                                   field=f"messages[{bad}]") from None
            raise CorruptError(f"{where}: the tokenizer cannot encode the rendered conversation "
                               f"({type(exc).__name__}: {exc})", field="messages") from None
        ids = np.asarray(enc.ids, dtype=np.int64)
        return ids, _overlap_mask(enc.offsets, spans, ids.size)

    def _text_spans(self, messages: list[dict[str, Any]], full: str, roles: tuple[str, ...],
                    where: str) -> list[tuple[int, int]]:
        """The text of each message of ``roles``, found by rendering prefixes (templates without
        marks): what the first ``i + 1`` messages add to the first ``i``, after the message's
        role header (the generation prompt of an assistant message, or else the text the
        message's rendering keeps with any content, :meth:`_header_end`)."""
        prefix: dict[int, str] = {}

        def upto(k: int) -> str:
            if k not in prefix:
                prefix[k] = self._render(messages[:k], False, where)
            return prefix[k]
        spans = []
        for i, m in enumerate(messages):
            if m["role"] not in roles:
                continue
            before, after = upto(i), upto(i + 1)
            head = self._render(messages[:i], True, where) if m["role"] == "assistant" else before
            if not full.startswith(after) or not after.startswith(head) or not head.startswith(before):
                raise ConfigError(f"chat template: the rendering of the first {i + 1} messages is not a prefix of the "
                                  f"whole conversation's, so a message's tokens cannot be told apart; this template "
                                  f"cannot make a loss mask", path=self.folder, field="chat_template")
            start = len(head)
            if head == before:      # no generation prompt: the message's header is in what it adds
                start = self._header_end(messages, i, before, after)
            spans.append((start, len(after)))
        return spans

    def _header_end(self, messages: list[dict[str, Any]], i: int, before: str, after: str) -> int:
        """Where message ``i``'s content starts in ``after`` (the rendering up to it): the
        renderings of the message with two different contents agree up to there. ``len(before)``
        (the whole message trained on) when that cannot be told: no string or list content,
        a template that fails or renders the probes unlike the message."""
        content = messages[i].get("content")
        if isinstance(content, str):
            probes: tuple[Any, Any] = (_PROBES[0], _PROBES[1])
        elif isinstance(content, list):
            probes = ([{"type": "text", "text": _PROBES[0]}], [{"type": "text", "text": _PROBES[1]}])
        else:
            return len(before)
        try:
            a, b = (self._render_raw([*messages[:i], {**messages[i], "content": p}]) for p in probes)
        except Exception:  # a template that takes no such content: no header is told apart
            return len(before)
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        if n < len(before) or n > len(after) or a[:n] != after[:n] or n == len(a):
            return len(before)
        return n


#: Two contents that differ in their first character and that no template trims or changes
#: (private-use characters): where the renderings of a message with one and with the other
#: part ways is where its content starts.
_PROBES = ("\ue000", "\ue001")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _read_template(folder: str) -> tuple[dict[str, Any], str]:
    """``(tokenizer_config.json, chat template)`` of a tokenizer folder: the config's
    ``chat_template`` (of named ones, the default), else ``chat_template.jinja``.

    Raises:
        CorruptError: a config that is not JSON.
        NotFoundError: no template.
    """
    config_path = os.path.join(folder, "tokenizer_config.json")
    config: dict[str, Any] = {}
    if os.path.exists(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except ValueError as exc:
            raise CorruptError(f"tokenizer_config.json: not JSON ({exc})", path=config_path,
                               field="tokenizer_config.json") from None
    template = config.get("chat_template")
    if isinstance(template, list):        # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if template is None and os.path.exists(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            template = f.read()
    if not isinstance(template, str) or not template:
        raise NotFoundError("chat template: none in tokenizer_config.json or chat_template.jinja", path=folder,
                            field="chat_template")
    return config, template


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as ``transformers`` (5.x) hands them to the template: keys whose value is
    None dropped (``_normalize_chat_messages``), and a message's reasoning under all of
    ``thinking`` and ``reasoning_content`` (``_alias_reasoning_fields``)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _overlap_mask(offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]], n: int) -> np.ndarray:
    """1 on each token whose characters overlap a span, as ``apply_chat_template`` makes its
    assistant mask: walking the spans in order, a token is masked when it ends after the
    start of the first span that ends after the token starts."""
    mask = np.zeros(n, np.uint8)
    if not spans or not n:
        return mask
    starts = np.fromiter((a for a, _ in offsets), np.int64, n)
    ends = np.fromiter((b for _, b in offsets), np.int64, n)
    span_starts = np.array([a for a, _ in spans], np.int64)
    span_ends = np.array([b for _, b in spans], np.int64)
    if n > 1 and (np.diff(starts) < 0).any():      # offsets out of order: transformers' own walk
        j = 0
        for t in range(n):
            while j < len(spans) and starts[t] >= span_ends[j]:
                j += 1
            if j == len(spans):
                break
            mask[t] = ends[t] > span_starts[j]
        return mask
    # with the token starts in order, the walk's span for each token is the first whose end
    # (or an earlier one's: the running maximum) is past the token's start
    span_of = np.searchsorted(np.maximum.accumulate(span_ends), starts, side="right")
    inside = span_of < len(spans)
    mask[inside] = ends[inside] > span_starts[span_of[inside]]
    return mask


def _has_surrogates(value: Any) -> bool:
    """Whether a string anywhere in ``value`` (strings, lists, dicts) holds a lone UTF-16
    surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_surrogates(k) or _has_surrogates(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_has_surrogates(v) for v in value)
    return False


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]        # an AddedToken written out
    return None

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
default) and 0 elsewhere. A message's tokens are found from the rendering itself: the text of
message ``i`` is what the rendering of messages ``0..i`` adds to that of ``0..i-1`` (for an
assistant message, to that of ``0..i-1`` with the generation prompt, so the role header the
template writes before a reply is not trained on); a token belongs to the message its first
character is in. Templates that do not render conversations append-only (a later message
changing the text of an earlier one) are refused by name.

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
from typing import Any

import numpy as np

from zerobatch.formats.errors import ConfigError, CorruptError, NotFoundError

__all__ = ["ChatTemplate"]
#: The roles whose tokens are trained on unless told otherwise.
DEFAULT_ROLES = ("assistant",)


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
        self.specials = {k: _token_text(v) for k, v in config.items()
                         if k.endswith("_token") and _token_text(v) is not None}
        try:
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ConfigError("--chat needs jinja2: pip install 'zerobatch-cli[chat]'", field="chat") from None

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        class Generation(jinja2.ext.Extension):
            """``{% generation %}...{% endgeneration %}`` (transformers' marks of assistant
            text): rendered as its body (the mask comes from the rendering of each message)."""

            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                next(parser.stream)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

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
        digest = hashlib.sha256(json.dumps([template, self.specials, self.roles]).encode("utf-8"))
        digest.update(self.tokenizer.to_str().encode("utf-8"))
        #: what decides the ids and masks: the template, special tokens, roles and tokenizer
        self.fingerprint = digest.hexdigest()[:32]

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The text of ``messages`` (as ``apply_chat_template(..., tokenize=False)``)."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.specials)
        except self._errors as exc:
            raise ConfigError(f"chat template: {exc}", path=self.folder, field="chat_template") from None

    def encode(self, messages: Any, *, where: str = "conversation") -> tuple[np.ndarray, np.ndarray]:
        """``(ids, loss mask)`` of one conversation.

        Raises:
            CorruptError: ``messages`` is not a list of ``{"role": str, "content": ...}``.
            ConfigError: the template does not render conversations append-only.
        """
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                     for m in messages):
            raise CorruptError(f"{where}: messages must be a list of {{'role': ..., 'content': ...}}", field="messages")
        full = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] not in self.roles:
                continue
            head = self.render(messages[:i], add_generation_prompt=m["role"] == "assistant") if i else (
                self.render([], add_generation_prompt=m["role"] == "assistant"))
            upto = self.render(messages[:i + 1])
            if not full.startswith(upto) or not upto.startswith(head):
                raise ConfigError(f"chat template: the rendering of the first {i + 1} messages is not a prefix of the "
                                  f"whole conversation's, so a message's tokens cannot be told apart; this template "
                                  f"cannot make a loss mask", path=self.folder, field="chat_template")
            spans.append((len(head), len(upto)))
        enc = self.tokenizer.encode(full, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int64)
        mask = np.zeros(ids.size, np.uint8)
        if spans and ids.size:
            first = np.fromiter((a for a, _ in enc.offsets), np.int64, ids.size)
            for a, b in spans:
                mask[(first >= a) & (first < b)] = 1
        return ids, mask


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]        # an AddedToken written out
    return None

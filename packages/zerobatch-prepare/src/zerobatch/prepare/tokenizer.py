"""The tokenizers ``zerobatch convert`` (and ``head`` / ``stats --tokenizer``) work with, behind
one small interface.

``--tokenizer`` names one of:

* a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library), or a tokenizer folder holding
  one (what ``convert --chat`` takes; a folder with only a SentencePiece ``tokenizer.model`` is
  read as that model);
* ``tiktoken:NAME``: a tiktoken encoding (``tiktoken:gpt2``, what nanoGPT's ``prepare.py``
  uses; ``r50k_base`` is the same encoding; ``cl100k_base``, ``o200k_base``...). tiktoken
  downloads an encoding's file once into ``TIKTOKEN_CACHE_DIR``; on a machine without network
  access copy that cache there first;
* a SentencePiece ``.model`` file (Llama 2, Mistral, T5...);

and from Python also any callable ``texts -> token id lists`` (custom preprocessing; with
``workers > 1`` it must be picklable: a module-level function).

Special tokens written as text. A document that contains the literal text of a special
token (``<|endoftext|>``, ``<s>``...) is tokenized as *ordinary text* by every backend, as
nanoGPT's ``prepare.py`` does with tiktoken's ``encode_ordinary``: text can never forge a
document boundary. (Hugging Face ``tokenizers`` on its own matches added tokens inside text;
convert sets its ``encode_special_tokens`` so it does not.) The end-of-document id (and the
beginning one, with ``--add-bos`` / ``--bos-id``) is added by convert, outside the text.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any

from zerobatch.formats.errors import ConfigError, CorruptError, NotFoundError

__all__ = ["TextTokenizer", "load_tokenizer"]

TIKTOKEN_PREFIX = "tiktoken:"


class TextTokenizer:
    """One tokenizer, whatever its library.

    Attributes:
        spec: what the user named (a path, ``tiktoken:NAME``, or a callable).
        fingerprint: identifies its vocabulary and rules (a staged conversion made with
            another tokenizer is not resumed).
        vocab_size: ids are below it (``None``: unknown, a plain function).
    """

    spec: Any
    fingerprint: str
    vocab_size: int | None = None

    def encode_batch(self, texts: list[str]) -> Sequence[Sequence[int]]:
        """The ids of each text, special-token text encoded as ordinary text."""
        raise ConfigError(f"{self.spec!r} cannot encode", field="tokenizer")

    def decode(self, ids: list[int]) -> str:
        raise ConfigError(f"{self.spec!r} cannot decode", field="tokenizer")

    def token_to_id(self, name: str) -> int | None:
        """The id of special token ``name`` (``None``: the vocabulary has no such token)."""
        return None

    def label(self, i: int) -> str:
        """How one id reads, for people: its decoded text (``" the"``, not ``"Ġthe"``), or
        the token's own spelling where one id alone is not whole text (a byte of a character)."""
        text = self.decode([i])
        if "\ufffd" in text:
            raw = self._piece(i)
            if raw is not None:
                return raw
        return text

    def _piece(self, i: int) -> str | None:
        return None


class _HF(TextTokenizer):
    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise NotFoundError("tokenizer: no such file", path=path, field="tokenizer")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("tokenizing text needs the tokenizers library: pip install tokenizers",
                              field="tokenizer") from None
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as exc:  # tokenizers raises a bare Exception for a bad file
            raise CorruptError(f"tokenizer: not a tokenizer.json the tokenizers library can load ({exc})", path=path,
                               field="tokenizer") from None
        if hasattr(self.tok, "encode_special_tokens"):
            self.tok.encode_special_tokens = True
        self.spec = path
        with open(path, "rb") as f:
            self.fingerprint = "hf:" + hashlib.sha256(f.read()).hexdigest()
        self.vocab_size = int(self.tok.get_vocab_size(with_added_tokens=True))

    def encode_batch(self, texts: list[str]) -> Sequence[Sequence[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, name: str) -> int | None:
        return self.tok.token_to_id(name)

    def _piece(self, i: int) -> str | None:
        return self.tok.id_to_token(i)


class _Tiktoken(TextTokenizer):
    def __init__(self, spec: str) -> None:
        name = spec[len(TIKTOKEN_PREFIX):]
        try:
            import tiktoken
        except ImportError:
            raise ConfigError("tiktoken encodings need the tiktoken library: pip install 'zerobatch-prepare[tiktoken]'",
                              field="tokenizer") from None
        try:
            self.enc = tiktoken.get_encoding(name)
        except ValueError as exc:
            raise ConfigError(f"--tokenizer: {exc}", field="tokenizer") from None
        except Exception as exc:  # the download of the encoding's file: requests' and OS errors
            raise NotFoundError(f"--tokenizer: tiktoken could not load encoding {name!r} ({type(exc).__name__}: "
                                f"{exc}); without network access, copy its file into TIKTOKEN_CACHE_DIR",
                                path=spec, field="tokenizer") from None
        self.spec = spec
        ranks = hashlib.sha256()
        for token, rank in sorted(self.enc._mergeable_ranks.items(), key=lambda kv: kv[1]):
            ranks.update(token + rank.to_bytes(4, "little"))
        ranks.update(repr((self.enc._pat_str, sorted(self.enc._special_tokens.items()))).encode())
        self.fingerprint = f"tiktoken:{self.enc.name}:{ranks.hexdigest()}"
        self.vocab_size = int(self.enc.n_vocab)

    def encode_batch(self, texts: list[str]) -> Sequence[Sequence[int]]:
        return self.enc.encode_ordinary_batch(texts, num_threads=1)

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)

    def token_to_id(self, name: str) -> int | None:
        return self.enc._special_tokens.get(name)

    def _piece(self, i: int) -> str | None:
        return repr(self.enc.decode_single_token_bytes(i))


class _SentencePiece(TextTokenizer):
    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise NotFoundError("tokenizer: no such file", path=path, field="tokenizer")
        try:
            import sentencepiece
        except ImportError:
            raise ConfigError("SentencePiece models need the sentencepiece library: pip install "
                              "'zerobatch-prepare[sentencepiece]'", field="tokenizer") from None
        with open(path, "rb") as f:
            blob = f.read()
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_proto=blob)
        except Exception as exc:  # sentencepiece raises RuntimeError / OSError for a bad model
            raise CorruptError(f"tokenizer: not a SentencePiece model ({exc})", path=path, field="tokenizer") from None
        self.spec = path
        self.fingerprint = "sentencepiece:" + hashlib.sha256(blob).hexdigest()
        self.vocab_size = int(self.sp.get_piece_size())

    def encode_batch(self, texts: list[str]) -> Sequence[Sequence[int]]:
        return self.sp.encode(texts, out_type=int)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)

    def token_to_id(self, name: str) -> int | None:
        i = int(self.sp.piece_to_id(name))
        return i if i != self.sp.unk_id() or name == self.sp.id_to_piece(i) else None

    def _piece(self, i: int) -> str | None:
        return self.sp.id_to_piece(i)


class _Function(TextTokenizer):
    def __init__(self, fn: Callable[[list[str]], Sequence[Sequence[int]]]) -> None:
        self.fn = fn
        self.spec = fn
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
        self.fingerprint = f"function:{name}"

    def encode_batch(self, texts: list[str]) -> Sequence[Sequence[int]]:
        out = self.fn(texts)
        if len(out) != len(texts):
            raise ConfigError(f"tokenizer: {self.fingerprint[9:]} returned {len(out)} id lists for {len(texts)} texts",
                              field="tokenizer")
        return list(out)


def load_tokenizer(spec: Any) -> TextTokenizer:
    """The tokenizer ``spec`` names (see the module documentation).

    Raises:
        NotFoundError: no such file, a folder without a tokenizer, or a tiktoken encoding that
            cannot be loaded.
        CorruptError: a file its library cannot load.
        ConfigError: the library is not installed, or an unknown tiktoken encoding.
    """
    if isinstance(spec, TextTokenizer):
        return spec
    if callable(spec):
        return _Function(spec)
    spec = os.fspath(spec)
    if spec.startswith(TIKTOKEN_PREFIX):
        return _Tiktoken(spec)
    if os.path.isdir(spec):
        for name in ("tokenizer.json", "tokenizer.model"):
            if os.path.isfile(os.path.join(spec, name)):
                return load_tokenizer(os.path.join(spec, name))
        raise NotFoundError("tokenizer: the folder holds no tokenizer.json (nor a SentencePiece tokenizer.model)",
                            path=spec, field="tokenizer")
    if spec.endswith(".model"):
        return _SentencePiece(spec)
    return _HF(spec)

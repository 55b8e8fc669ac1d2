"""TOKSTREAM on the command line: its face for ``inspect`` / ``verify`` / ``head`` / ``stats`` /
``bench`` (its ``convert`` target is :mod:`zerobatch.prepare.formats.tokstream`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from zerobatch.cli.datasets import PIECE, Dataset, Progress, folder_size, human
from zerobatch.formats import tokstream as T
from zerobatch.formats.errors import CorruptError
from zerobatch.prepare.formats.tokstream import TokenStreamDocuments

__all__ = ["TRAINED", "TokStream", "show_trained"]

#: How ``head`` marks the tokens a chat dataset trains on: brackets, or (on a terminal) colour.
TRAINED = ("\u27e6", "\u27e7")
_COLOUR = ("\x1b[1;32m", "\x1b[0m")


def show_trained(ids: list[int], mask: np.ndarray, decode: Callable[[list[int]], str] | None, *,
                 chars: int | None = None, colour: bool = False) -> str:
    """One sample of a chat dataset for ``head``: its text (``decode``; ids written as numbers
    without it) with each run of tokens the loss mask trains on between :data:`TRAINED`
    brackets, or in colour; at most ``chars`` characters of it (a cut ends in ``[...]``)."""
    on_off = _COLOUR if colour else TRAINED
    flags = np.asarray(mask[: len(ids)], bool)
    cuts = [0, *(np.flatnonzero(np.diff(flags.astype(np.int8))) + 1).tolist(), len(ids)]
    out: list[str] = []
    shown = 0
    for a, b in zip(cuts[:-1], cuts[1:]):
        if a == b:
            continue
        text = decode(ids[a:b]) if decode is not None else " ".join(map(str, ids[a:b]))
        cut = chars is not None and shown + len(text) > chars
        if cut:
            text = text[: chars - shown]
        shown += len(text)
        sep = "" if decode is not None or not out else " "
        out.append(sep + (f"{on_off[0]}{text}{on_off[1]}" if flags[a] and text else text))
        if cut:
            return "".join(out) + " [...]"
    return "".join(out)


class TokStream(TokenStreamDocuments, Dataset):
    def info(self) -> list[tuple[str, Any]]:
        m, r = self.r.manifest, self.r
        size = (sum(f.size + T.TRAILER_SIZE for e in m.shards for f in e.files.values()) if r.remote
                else folder_size(self.path))
        block = f"{m.block >> 20} MiB" if m.block >= 1 << 20 else f"{m.block >> 10} KiB" if m.block >= 1 << 10 \
            else f"{m.block} B"
        return [
            ("format", f"TOKSTREAM v{m.version} (sharded token stream)" + (" at a URL" if r.remote else "")),
            ("tokens", r.num_tokens), ("documents", r.num_documents), ("shards", len(m.shards)),
            ("vocab_size", m.vocab_size), ("dtype", m.token_dtype),
            ("eod_token", m.eod_token if m.eod_token is not None else "none"),
            ("metadata", "per-token metadata ids + blobs" if m.metadata else "none"),
            ("checksums", f"XXH3-64 per {block} block of every file, index files in full"),
            ("build_id", m.build_id), ("size", f"{size} ({human(size)})"),
        ] + self._mask_info()

    def _mask_info(self) -> list[tuple[str, Any]]:
        from zerobatch.readers.tokstream import LOSS_MASK_DIR
        try:
            mask = self._loss_mask()
        except CorruptError as exc:
            return [("loss_mask", f"FAULT: {exc}")]
        if mask is None:
            return []
        with mask:
            return [("loss_mask",
                     f"{LOSS_MASK_DIR}/: one 0/1 per token (convert --chat), build {mask.manifest.build_id}")]

    def _loss_mask(self) -> Any:
        """The chat dataset's loss mask (``convert --chat``) checked to match, or None."""
        from zerobatch.formats.errors import NotFoundError
        from zerobatch.readers.tokstream import open_loss_mask
        try:
            return open_loss_mask(self.r)
        except NotFoundError:
            return None

    def verify(self, progress: Progress | None) -> tuple[list[str], str]:
        first = [0]

        def main_part(done: int, total: int) -> None:
            first[0] = total
            if progress is not None:
                progress(done, total)

        def mask_part(done: int, total: int) -> None:        # the bar goes on from the tokens' end
            if progress is not None:
                progress(first[0] + done, first[0] + total)
        report = self.r.verify(main_part)
        faults = [f"{p}: {msg}" for p, msg in report.problems]
        summary = (f"{report.shards} shards, {report.files} files, {human(report.bytes_checked)} checked "
                   "(checksums, indexes, vocabulary)")
        try:
            mask = self._loss_mask()
        except CorruptError as exc:     # a mask of another dataset, or a damaged one
            return [*faults, f"{exc.path}: {exc}"], summary
        if mask is not None:
            with mask:
                extra = mask.verify(mask_part)
            faults += [f"{p}: {msg}" for p, msg in extra.problems]
            summary += f"; its loss mask: {extra.shards} shards, {extra.files} files, {human(extra.bytes_checked)}"
        return faults, summary

    def sample_name(self) -> str:
        return "document"

    def sample_masks(self, n: int) -> list[np.ndarray] | None:
        mask = self._loss_mask()
        if mask is None:
            return None
        with mask:
            return [mask.document(i) for i in range(min(n, mask.num_documents))]

    def trained_tokens(self) -> tuple[int, int] | None:
        mask = self._loss_mask()
        if mask is None:
            return None
        with mask:
            trained = 0
            for s in range(0, mask.num_tokens, PIECE):
                trained += int(np.count_nonzero(mask.window(s, min(PIECE, mask.num_tokens - s))))
            return trained, int(mask.num_tokens)

    def samples(self, n: int) -> list[np.ndarray]:
        return [self.r.document(i) for i in range(min(n, self.r.num_documents))]

    def batch_reader(self, batch_size: int, seq_len: int, rng: np.random.Generator
                     ) -> tuple[Callable[[], Any], int, int]:
        out = np.empty((batch_size, seq_len), np.int64)
        n = self.r.num_tokens - seq_len + 1
        if n < 1:
            raise CorruptError(f"bench: the dataset holds fewer than {seq_len} tokens", path=self.path, field="seq_len")

        def read() -> Any:
            return self.r.windows(rng.integers(0, n, batch_size), seq_len, out=out)
        return read, max(1, self.r.num_tokens // (batch_size * seq_len)), batch_size * seq_len

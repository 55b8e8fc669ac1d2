"""The ``zerobatch`` command.

::

    zerobatch inspect FILE [--json]     header fields and derived sizes
    zerobatch verify FILE [--quiet]     check a whole file; exit 1 on any fault
    zerobatch bench [options]           write a sample .batch file, stream an epoch, print tokens/s

Exit status: 0 success, 1 a fault found in a file (``verify``) or a zerobatch error,
2 bad command-line usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from zerobatch.formats import llmbatch as L
from zerobatch.formats.errors import ZerobatchError

__all__ = ["main"]


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _detect(path: str) -> str:
    from zerobatch.core.io import open_regular_file, pread_exact

    fd, st = open_regular_file(path)
    try:
        magic = pread_exact(fd, min(8, st.st_size), 0, path=path, field="magic")
    finally:
        os.close(fd)
    if magic == L.MAGIC:
        return "llmbatch"
    from zerobatch.formats.errors import CorruptError

    raise CorruptError(f"magic: not a zerobatch file (first bytes {magic!r})", path=path, field="magic")


def cmd_inspect(args: argparse.Namespace) -> int:
    from zerobatch.readers.llmbatch import BatchFileReader

    _detect(args.file)
    with BatchFileReader(args.file, verify=False) as r:
        h = r.header
        if args.json:
            d = {"format": "LLMBATCH", "path": args.file, **h.to_dict()}
            print(json.dumps(d, indent=2))
            return 0
        rows = [
            ("format", f"LLMBATCH v{h.version}" + (" + zerobatch integrity extension" if h.has_extension else " (seed layout, no checksums)")),
            ("batch_size", h.batch_size),
            ("seq_len", h.seq_len),
            ("num_batches", h.num_batches),
            ("dtype", "uint32 (code 0)"),
            ("seed", h.seed),
            ("total_records", f"{h.total_records} ({h.total_records - h.num_batches * h.batch_size} dropped)"),
            ("tokens", h.num_tokens),
            ("raw_batch_bytes", h.raw_batch_bytes),
            ("padded_batch_bytes", f"{h.padded_batch_bytes} ({h.padded_batch_bytes - h.raw_batch_bytes} padding)"),
            ("data", f"bytes {h.data_offset}..{h.trailer_offset}"),
            ("file_size", f"{h.file_size} ({_human(h.file_size)})"),
        ]
        if h.has_extension:
            rows += [
                ("checksums", f"XXH3-64 per batch, trailer at {h.trailer_offset} ({h.trailer_size} bytes)" if h.has_checksums else "none"),
                ("max_token", h.max_token if h.max_token is not None else "not recorded"),
                ("int32 safe", "yes" if h.max_token is not None and h.max_token < 2**31 else "no"),
                ("build_id", h.build_id.hex() if h.build_id else ""),
            ]
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"{k:<{width}}  {v}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from zerobatch.readers.llmbatch import BatchFileReader

    _detect(args.file)
    started = time.perf_counter()
    with BatchFileReader(args.file, verify=False) as r:
        bar = None
        if not args.quiet and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=r.num_batches, unit="batch", desc="verify", file=sys.stderr)

        def progress(done: int, total: int) -> None:
            if bar is not None:
                bar.update(done - bar.n)

        report = r.verify(progress)
        if bar is not None:
            bar.close()
        elapsed = time.perf_counter() - started
        size = r.header.file_size
    faults = []
    if report.num_bad_batches:
        shown = ", ".join(map(str, report.bad_batches[:10]))
        faults.append(f"{report.num_bad_batches} batches do not match their checksums (first: {shown})")
    if not report.padding_ok:
        faults.append("page padding is not all zero")
    if not report.max_token_ok:
        faults.append(f"the header's max_token does not match the largest token id found ({report.max_token})")
    if faults:
        for f in faults:
            print(f"{args.file}: FAULT: {f}", file=sys.stderr)
        return 1
    if not args.quiet:
        what = "checksums, padding and max_token" if report.has_checksums else "structure and padding (no checksums in this file)"
        print(f"{args.file}: OK: {report.num_batches} batches, {what} verified "
              f"({_human(size)} in {elapsed:.2f} s)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from zerobatch.adapters.torch import BatchNativeLoader
    from zerobatch.writers.llmbatch import write_batch_dataset

    records, seq_len, batch_size = args.records, args.seq_len, args.batch_size
    folder = None
    path = args.path
    if path is None:
        folder = tempfile.TemporaryDirectory(prefix="zerobatch-bench-")
        path = os.path.join(folder.name, "sample.batch")
    try:
        rng = np.random.default_rng(0)

        def records_iter() -> Any:
            left = records
            while left:
                k = min(left, 4096)
                left -= k
                yield rng.integers(0, args.vocab, size=(k, seq_len), dtype=np.uint32)

        t0 = time.perf_counter()
        nb = write_batch_dataset(path, records_iter(), records, batch_size, seq_len, seed=args.seed)
        write_s = time.perf_counter() - t0
        size = os.path.getsize(path)
        print(f"wrote {path}: {nb} batches of {batch_size} x {seq_len} tokens, {_human(size)} "
              f"in {write_s:.2f} s ({size / write_s / 2**20:.0f} MiB/s)")
        loader = BatchNativeLoader(path, block_size=args.block_size, seed=args.seed,
                                   num_threads=args.threads)
        best = None
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            t0 = time.perf_counter()
            tokens = 0
            first = None
            for batch in loader:
                if first is None:
                    first = time.perf_counter() - t0
                tokens += batch.numel()
            dt = time.perf_counter() - t0
            rate = tokens / dt
            best = rate if best is None else max(best, rate)
            print(f"epoch {epoch}: {len(loader)} batches, {tokens} tokens as {batch.dtype if tokens else torch.int64} "
                  f"in {dt:.3f} s: {rate / 1e6:,.0f}M tokens/s (first batch after {1e3 * (first or 0):.2f} ms)")
        loader.close()
        print(f"best epoch: {best / 1e6:,.0f}M tokens/s")
    finally:
        if folder is not None:
            folder.cleanup()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from zerobatch.cli._version import __version__

    p = argparse.ArgumentParser(prog="zerobatch", description="Inspect, verify and benchmark zerobatch files.")
    p.add_argument("--version", action="version", version=f"zerobatch {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("inspect", help="print a file's header and derived sizes")
    s.add_argument("file")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("verify", help="check a whole file; exit 1 on any fault")
    s.add_argument("file")
    s.add_argument("-q", "--quiet", action="store_true", help="print faults only")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("bench", help="write a sample .batch file and stream epochs from it")
    s.add_argument("--records", type=int, default=65536, help="records to write (default 65536)")
    s.add_argument("--seq-len", type=int, default=512)
    s.add_argument("--batch-size", type=int, default=32)
    s.add_argument("--vocab", type=int, default=50257, help="token ids drawn from [0, vocab)")
    s.add_argument("--block-size", type=int, default=256)
    s.add_argument("--epochs", type=int, default=3)
    s.add_argument("--threads", type=int, default=2, help="read-ahead threads")
    s.add_argument("--seed", type=int, default=42)
    s.add_argument("--path", help="keep the sample file here (default: a temporary folder)")
    s.set_defaults(func=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ZerobatchError as exc:
        print(f"zerobatch {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

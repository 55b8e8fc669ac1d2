"""The ``zerobatch`` command.

::

    zerobatch convert SRC DST --to FORMAT     text / JSONL / Parquet / HF dataset / .npy / nanoGPT .bin /
                                              Megatron .bin+.idx  ->  llmbatch, llmchnk, tokstream, zrecord
    zerobatch inspect PATH [--json]           header or manifest, counts, sizes, dtype, build id, checksums
    zerobatch verify PATH                     full integrity check; exit 1 and the faulty file and place
    zerobatch head PATH -n N [--tokenizer T]  the first samples, decoded with a tokenizer
    zerobatch stats PATH [--plot out.png]     token and document-length distributions (--json: as JSON)
    zerobatch bench [PATH]                    read throughput and latency percentiles (no PATH: a sample)
    zerobatch quickstart                      tokenizer, conversion and a tiny LM trained through the loader

Every format is recognised from its bytes (file magic) or its folder's files. Exit status: 0
success, 1 a fault found (``verify``) or an error (one line on stderr, never a traceback;
``ZEROBATCH_DEBUG=1`` prints it), 2 bad command-line usage, 130 interrupted, 141 stdout closed
by its reader (``zerobatch stats X | head``: quietly, as SIGPIPE ends other tools).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np
from zerobatch.cli.plan import HELP as PLAN_HELP, add_plan
from zerobatch.cli.trace import HELP as TRACE_HELP, add_trace
from zerobatch.formats.errors import FormatError, NotFoundError, StateError, ZerobatchError, scrub
from zerobatch.formats import registry
from zerobatch.formats.tokstream import DEFAULT_SHARD_TOKENS

__all__ = ["EXIT_PIPE", "build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (``zerobatch convert: error: ...``) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _bar(args: argparse.Namespace, total: int, unit: str, desc: str) -> Any:
    if getattr(args, "quiet", False):
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, unit_scale=True, desc=desc, file=sys.stderr, mininterval=0.5,
                disable=None)


# --------------------------------------------------------------------------------------------


def _inspect_preparation(args: argparse.Namespace) -> bool:
    """``inspect`` of a folder (or URL) holding an uncommitted distributed preparation (a
    plan and unit records, no manifest): its state and how to finish it; False otherwise."""
    from zerobatch.core.remote import is_url, local_path
    from zerobatch.prepare.tasks import preparation_status
    path = local_path(args.path)
    if not (is_url(path) or os.path.isdir(path)):
        return False
    try:
        st = preparation_status(path)
    except (FormatError, StateError):
        raise                       # a damaged plan or record: said as such
    except ZerobatchError:
        return False                # not a store this can list (a file's URL...): the formats say what it is
    if st is None:
        return False
    left = st["units"] - st["finished_units"]
    if left:
        owners = st["unfinished_tasks"]
        shown = ", ".join(map(str, owners[:20])) + (", ..." if len(owners) > 20 else "")
        st["next"] = (f"{left} unit{'s are' if left != 1 else ' is'} not finished yet: wait for task"
                      f"{'s' if len(owners) != 1 else ''} {shown} of {st['tasks']} (run a task again only if it "
                      f"failed), then run zerobatch commit {st['path']}")
    else:
        st["next"] = f"every unit is finished: run zerobatch commit {st['path']}"
    if args.json:
        print(json.dumps(st, indent=2))
        return True
    rows = [("format", st["format"] + (", chat with its loss mask" if st["chat"] else "")),
            ("units", f"{st['finished_units']} of {st['units']} finished"), ("tasks", str(st["tasks"])),
            ("next", st["next"])]
    print(f"{'path':<6}  {_shown(args.path)}")
    for k, v in rows:
        print(f"{k:<6}  {v}")
    return True


def cmd_inspect(args: argparse.Namespace) -> int:
    if _inspect_preparation(args):
        return 0
    ds = _datasets().open_dataset(args.path, field=getattr(args, "field", None))
    try:
        rows = ds.info()
        if args.json:
            d: dict[str, Any] = ds.json_info() if hasattr(ds, "json_info") else {
                "format": ds.kind.upper(), "path": _shown(args.path),
                **{("description" if k == "format" else k): v for k, v in rows}}
            print(json.dumps(d, indent=2, default=str))
            return 0
        width = max(len(k) for k, _ in rows)
        print(f"{'path':<{width}}  {_shown(args.path)}")
        for k, v in rows:
            print(f"{k:<{width}}  {v}")
    finally:
        ds.close()
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        ds = _datasets().open_dataset(args.path)
    except NotFoundError:
        raise
    except ZerobatchError as exc:   # structure damaged: a fault of the file, not of the command
        print(_fault(_shown(args.path), exc), file=sys.stderr)
        return 1
    try:
        bar = _bar(args, 0, "", "verify")

        def progress(done: int, total: int) -> None:
            if bar is not None:
                bar.total = total
                bar.update(done - bar.n)
        try:
            faults, summary = ds.verify(progress)
        except ZerobatchError as exc:
            print(_fault(_shown(args.path), exc), file=sys.stderr)
            return 1
        if bar is not None:
            bar.close()
    finally:
        ds.close()
    if faults:
        for f in faults:
            print(f"{_shown(args.path)}: FAULT: {f}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"{_shown(args.path)}: OK: {summary} in {time.perf_counter() - started:.2f} s")
    return 0


def _fault(path: str, exc: ZerobatchError) -> str:
    text = str(exc)     # names the file at fault already when the error knows it
    return f"FAULT: {text}" if exc.path else f"{path}: FAULT: {text}"


def _decoder(path: str | None) -> Any:
    if not path:
        return None
    from zerobatch.prepare.tokenizer import load_tokenizer

    return load_tokenizer(path)


def cmd_head(args: argparse.Namespace) -> int:
    if args.n < 0:
        raise _usage(args, "-n must be at least 0")
    tok = _decoder(args.tokenizer)
    ds = _datasets().open_dataset(args.path, field=args.field)
    try:
        masks = ds.sample_masks(args.n) if ds.tokens else None
        if masks is not None:      # a chat dataset: the tokens its loss mask trains on, marked
            from zerobatch.cli.formats.tokstream import TRAINED, show_trained
            colour = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
            print("tokens trained on (loss mask 1) are shown " +
                  ("in green" if colour else f"{TRAINED[0]}between these brackets{TRAINED[1]}"))
        for i, s in enumerate(ds.samples(args.n)):
            if not ds.tokens:
                print(f"{ds.sample_name()} {i}: " + np.array2string(s, precision=4, max_line_width=120))
                continue
            ids = s.reshape(-1).tolist()
            if masks is not None and i < len(masks):
                print(f"--- {ds.sample_name()} {i} ({len(ids)} tokens, {int(np.count_nonzero(masks[i]))} trained on)")
                shown = ids if tok is not None or args.full or len(ids) <= 64 else ids[:64]
                text = show_trained(shown, masks[i], tok.decode if tok is not None else None,
                                    chars=None if args.full or tok is None else args.chars, colour=colour)
                print(text + (" ..." if len(shown) < len(ids) else ""))
                continue
            print(f"--- {ds.sample_name()} {i} ({len(ids)} tokens)")
            if tok is not None:
                text = tok.decode(ids)
                print(text if args.full or len(text) <= args.chars else text[:args.chars] + " [...]")
            else:
                shown = ids if args.full or len(ids) <= 64 else ids[:64]
                print(" ".join(map(str, shown)) + (" ..." if len(shown) < len(ids) else ""))
    finally:
        ds.close()
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    tok = _decoder(args.tokenizer)
    ds = _datasets().open_dataset(args.path, field=args.field)
    try:
        if not args.json:
            print(f"{_shown(args.path)}: {ds.kind}")
        if not ds.tokens:
            # as_json only when asked: a format of another distribution may predate it
            return ds.print_value_stats(_shown(args.path), top=args.top, plot=args.plot,
                                        **({"as_json": True} if args.json else {}))
        counts, total, lengths = _count_tokens(ds, args.eod)
        noun = "document" if args.eod is not None else ds.sample_name()
        what = "documents (split at --eod)" if args.eod is not None else f"{noun}s"
        trained = ds.trained_tokens()
        order = [int(i) for i in np.argsort(-counts, kind="stable")[: args.top] if counts[i]]
        lens = _datasets().summary(lengths)
        if args.plot:
            _plot_tokens(args.plot, counts, lengths, what, noun, args.path)
        if args.json:
            out: dict[str, Any] = {
                "path": _shown(args.path), "format": ds.kind.upper(), "tokens": total,
                "distinct_ids": int(np.count_nonzero(counts)), "largest_id": counts.size - 1 if total else None,
                f"{noun}s": lens["count"], "lengths": {"of": what, **lens},
                "trained_tokens": trained[0] if trained is not None else None,
                "trained_fraction": trained[0] / max(trained[1], 1) if trained is not None else None,
                "most_frequent": [{"id": i, "count": int(counts[i]), "fraction": float(counts[i] / max(total, 1)),
                                   **({"text": tok.label(i)} if tok is not None else {})} for i in order]}
            if args.eod is not None:
                out["split_at_eod"] = args.eod
            if args.plot:
                out["plot"] = args.plot
            print(json.dumps(out, indent=2))
            return 0
        print(f"tokens: {total:,}  distinct ids: {int(np.count_nonzero(counts)):,}  largest id: "
              f"{f'{counts.size - 1:,}' if total else 'none'}")
        if trained is not None:     # a chat dataset: what its loss mask keeps
            print(f"trained on (loss mask 1): {trained[0]:,} of {trained[1]:,} tokens "
                  f"({100 * trained[0] / max(trained[1], 1):.2f} %)")
        if lens.get("all_equal"):   # one length: a histogram of it would say nothing
            print(f"{what}: {lens['count']:,}, {_all_equal(noun, lens['min'])}")
        else:
            print(_datasets().dist(f"{what} (tokens each)", lengths))
        print(f"most frequent {len(order)} ids:")
        for i in order:
            label = f"  {tok.label(i)!r}" if tok is not None else ""
            print(f"  {i:>8}  {int(counts[i]):>12,}  {100 * counts[i] / max(total, 1):6.2f} %{label}")
        if args.plot:
            print(f"wrote {args.plot}")
    finally:
        ds.close()
    return 0


def _count_tokens(ds: Any, eod: int | None) -> tuple[np.ndarray, int, np.ndarray]:
    """``(occurrences of each id, tokens, lengths)``: the lengths of the documents that ``eod``
    ends, in reading order (the last need not end with it), or else of the dataset's own
    documents or records."""
    counts = np.zeros(0, np.int64)
    total = 0
    doc_lengths: list[np.ndarray] = []
    carry = 0
    for piece in ds.token_pieces():
        if piece.size == 0:
            continue
        top = int(piece.max())
        if top >= counts.size:
            counts = np.concatenate([counts, np.zeros(top + 1 - counts.size, np.int64)])
        counts[: top + 1] += np.bincount(piece, minlength=top + 1)
        total += piece.size
        if eod is not None:   # documents from the end-of-document id in reading order
            ends = np.flatnonzero(piece == eod)
            if ends.size:
                lens = np.diff(np.concatenate([[-1], ends]))
                lens[0] += carry
                doc_lengths.append(lens)
                carry = piece.size - 1 - int(ends[-1])
            else:
                carry += piece.size
    if eod is None:
        return counts, total, ds.lengths()
    if carry:
        doc_lengths.append(np.array([carry], np.int64))
    return counts, total, np.concatenate(doc_lengths) if doc_lengths else np.zeros(0, np.int64)


def _all_equal(noun: str, length: int) -> str:
    return f"every {noun} holds {length:,} token{'s' if length != 1 else ''}"


#: Percentiles marked on the length histogram, with the colour of each mark.
_MARKS = (("p50", 50, "tab:green"), ("p90", 90, "tab:orange"), ("p99", 99, "tab:red"), ("max", 100, "black"))


def _token_figure(counts: np.ndarray, lengths: np.ndarray, what: str, noun: str, title: str) -> Any:
    """The ``stats --plot`` figure: the length histogram (log-spaced bins on a log axis when
    the longest is at least 4 times the shortest, else a bin per length, at most 100) with p50, p90, p99
    and max marked, beside the rank-frequency curve; when every length is the same, only the
    curve, and the title says the length."""
    plt = _datasets().pyplot()
    freq = np.sort(counts[counts > 0])[::-1]
    equal = lengths.size > 0 and int(lengths.min()) == int(lengths.max())
    if equal:
        fig, rank = plt.subplots(1, 1, figsize=(6, 4))
        fig.suptitle(f"{title}: {lengths.size:,} {what}, {_all_equal(noun, int(lengths[0]))}")
    else:
        fig, (hist, rank) = plt.subplots(1, 2, figsize=(11, 4))
        fig.suptitle(title)
        _length_histogram(hist, lengths, what)
    rank.loglog(np.arange(1, freq.size + 1), freq)
    rank.set(title="token frequency by rank", xlabel="rank", ylabel="occurrences")
    fig.tight_layout()
    return fig


def _length_histogram(ax: Any, lengths: np.ndarray, what: str) -> None:
    name = f"{what}: length distribution"
    shown = lengths[lengths > 0]
    if not shown.size:
        ax.set(title=f"{name} (none)" if not lengths.size else f"{name} (all empty)", xlabel="tokens", ylabel="count")
        return
    lo, hi = int(shown.min()), int(shown.max())
    if hi >= 4 * lo:        # a wide spread: equal steps in the logarithm, each bin holding a whole length
        bins = int(np.clip(2 * np.sqrt(shown.size), 10, 60))
        edges = np.unique(np.round(np.geomspace(lo, hi + 1, bins + 1))) - 0.5
        ax.set_xscale("log")
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
        # lengths as plain numbers (10, 20, 50: not 2 x 10^1), 1-2-5 steps over up to three decades
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if hi < 1000 * lo else (1.0,)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        empty = int(lengths.size - shown.size)
        if empty:           # a log axis has no place for 0
            name += f" ({empty:,} empty not shown)"
        ax.hist(shown, bins=edges)
    else:
        lo = int(lengths.min())     # empty ones included: a linear axis shows them
        edges = np.arange(lo - 0.5, hi + 1.5) if hi - lo < 100 else np.linspace(lo - 0.5, hi + 0.5, 101)
        ax.hist(lengths, bins=edges)
    values = np.percentile(lengths, [q for _, q, _ in _MARKS])
    for (label, _, colour), v in zip(_MARKS, values):
        if v > 0:
            ax.axvline(v, color=colour, linestyle="--", linewidth=1, label=f"{label} {v:,.0f}")
    ax.legend(fontsize="small")
    ax.set(title=name, xlabel="tokens" + (" (log scale)" if ax.get_xscale() == "log" else ""), ylabel="count")


def _plot_tokens(path: str, counts: np.ndarray, lengths: np.ndarray, what: str, noun: str, title: str) -> None:
    plt = _datasets().pyplot()
    fig = _token_figure(counts, lengths, what, noun, title)
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.path is None:
        return _bench_sample(args)
    ds = _datasets().open_dataset(args.path, field=getattr(args, "field", None))
    try:
        rng = np.random.default_rng(args.seed)
        read, units, tokens = ds.batch_reader(args.batch_size, args.seq_len, rng)
        trial_reads = args.reads
        print(f"{_shown(args.path)}: {ds.kind}; random batches "
              f"({'the stored batches' if ds.stored_batches else f'{args.batch_size} x {args.seq_len}'}), "
              f"int64 into a reused buffer, warm page cache")
        rates = []
        lat: list[float] = []
        for _ in range(args.trials):
            t = _datasets().time_reads(read, trial_reads)
            lat += t
            rates.append(tokens * trial_reads / sum(t))
        unit = "tokens" if ds.tokens else "rows"
        rate = float(np.median(rates))
        print(f"throughput: {rate / 1e6:,.1f}M {unit}/s (median of {args.trials} trials of {trial_reads} reads; "
              f"{rate * 8 / 2**30 if ds.tokens else 0:,.2f} GiB/s of int64)" if ds.tokens else
              f"throughput: {rate / 1e6:,.2f}M {unit}/s (median of {args.trials} trials of {trial_reads} reads)")
        p = _datasets().percentiles(lat)
        print("latency per batch:")
        for k in ("avg", "p50", "p95", "p99"):
            print(f"  {k:<4} {p[k] * 1e3:.3f} ms")
    finally:
        ds.close()
    return 0


def _bench_sample(args: argparse.Namespace) -> int:
    import torch
    from zerobatch.adapters.torch import BatchNativeLoader
    from zerobatch.writers.llmbatch import write_batch_dataset

    records, seq_len, batch_size = args.records, args.seq_len, args.batch_size
    with tempfile.TemporaryDirectory(prefix="zerobatch-bench-") as folder:
        path = args.keep or os.path.join(folder, "sample.batch")
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
        print(f"wrote {path}: {nb} batches of {batch_size} x {seq_len} tokens, {_datasets().human(size)} "
              f"in {write_s:.2f} s ({size / write_s / 2**20:.0f} MiB/s)")
        loader = BatchNativeLoader(path, block_size=args.block_size, seed=args.seed, num_threads=args.threads)
        best = 0.0
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
            best = max(best, rate)
            print(f"epoch {epoch}: {len(loader)} batches, {tokens} tokens as {batch.dtype if tokens else torch.int64} "
                  f"in {dt:.3f} s: {rate / 1e6:,.0f}M tokens/s (first batch after {1e3 * (first or 0):.2f} ms)")
        loader.close()
        print(f"best epoch: {best / 1e6:,.0f}M tokens/s")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from zerobatch.prepare.pipeline import ConvertOptions, convert

    options = {f: getattr(args, f) for f in ConvertOptions.__dataclass_fields__ if f not in ("to", "shuffle")}
    convert(args.src, args.dst, to=args.to, shuffle=not args.no_shuffle, **options,
            log=lambda s: print(s, file=sys.stderr if s.startswith(("resumed", "/")) else sys.stdout))
    return 0


def cmd_quickstart(args: argparse.Namespace) -> int:
    from zerobatch.cli.quickstart import quickstart

    return quickstart(steps=args.steps, workdir=args.workdir, vocab=args.vocab, seq_len=args.seq_len,
                      batch_size=args.batch_size, text=args.text, seed=args.seed)


def cmd_formats(args: argparse.Namespace) -> int:
    """The format registry: each format's name, layout, how it is recognised, and whether
    ``convert --to`` writes it."""
    rows = [{"name": f.name, "title": f.title, "layout": f.layout,
             "detected_by": f.magic.decode("latin-1") if f.magic else " + ".join(f.markers),
             "convert_target": bool(f.convert), "spec": f.spec, "summary": f.summary} for f in registry.formats()]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        to = "  (convert --to)" if r["convert_target"] else ""
        print(f"{r['name']:<{width}}  {r['layout']:<6}  {r['detected_by']!s:<28}  {r['summary']}{to}")
    return 0


def _usage(args: argparse.Namespace, message: str) -> SystemExit:
    print(f"zerobatch {args.command}: error: {message} (see zerobatch {args.command} --help)", file=sys.stderr)
    return SystemExit(2)


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("give field names, comma-separated")
    return names


def _nonnegative(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} is negative")
    return v


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} is not a positive integer")
    return v


#: Each command's description (beyond its one-line help) and one example, shown by its --help.
COMMAND_HELP = {
    "convert": ("Convert SRC into DST. Text sources (--from text, jsonl, parquet, hf) are tokenized with "
                "--tokenizer on --workers processes, each document ended with the end-of-document id; an "
                "interrupted conversion resumes from DST.zbconvert/. Token files (npy, nanogpt, megatron) and "
                "zerobatch datasets are copied from a memory map; --to megatron / nanogpt export back. An existing "
                "DST is refused before any work (--overwrite replaces it).",
                "zerobatch convert corpus.jsonl corpus --to tokstream --tokenizer tiktoken:gpt2 --split 98,1,1"),
    "inspect": ("Print what a dataset's header or manifest says: its format, counts, sizes and options.",
                "zerobatch inspect corpus --json"),
    "verify": ("Read the whole dataset and check every checksum and index; exit 1 naming the faulty file and "
               "place.", "zerobatch verify train.batch"),
    "head": ("Print the first samples (documents, records or rows), decoded to text with --tokenizer.",
             "zerobatch head corpus -n 2 --tokenizer tokenizer.json"),
    "stats": ("Count every token id and the length of every document (or record), with p50/p90/p99/max; "
              "--plot draws both (lengths on a log axis when they spread), --json prints the figures.",
              "zerobatch stats corpus --tokenizer tokenizer.json --plot corpus.png"),
    "bench": ("Time random batch reads of PATH (throughput and p50/p95/p99 latency); without PATH, write a "
              "sample .batch file and stream epochs from it through the loader.",
              "zerobatch bench corpus --batch-size 32 --seq-len 2048"),
    "formats": ("List the formats this installation reads and writes, with their readers, writers and "
                "specifications.", "zerobatch formats --json"),
    "commit": ("Assemble the TOKSTREAM dataset that the tasks of convert --task I --tasks N prepared in DST: the "
               "manifest from the finished parts in input order, without reading tokens. Refuses, changing "
               "nothing, while a task has not finished (naming the tasks to run again); running it twice is "
               "harmless.", "zerobatch commit out    # after: zerobatch convert docs/ out --to tokstream "
               "--tokenizer tokenizer.json --task I --tasks N, for I in 0..N-1"),
    "trace": TRACE_HELP,
    "plan": PLAN_HELP,
    "quickstart": ("Train a byte-level BPE tokenizer on a bundled public-domain text, convert it to TOKSTREAM and "
                   "LLMBATCH, and train a tiny causal LM for --steps steps through the zerobatch loader, on the CPU "
                   "(under a minute on 2 cores; nothing downloaded).", "zerobatch quickstart --steps 100"),
}


def _describe(sub: Any) -> None:
    """Give every command its description and example (:data:`COMMAND_HELP`)."""
    for name, parser in sub.choices.items():
        text, example = COMMAND_HELP[name]
        parser.description = text
        parser.epilog = f"example:\n  {example}"
        parser.formatter_class = argparse.RawDescriptionHelpFormatter


def _datasets() -> Any:
    """:mod:`zerobatch.cli.datasets`, imported when a command needs it (a command that does not,
    such as ``trace``, starts without the preparation modules it brings)."""
    from zerobatch.cli import datasets
    return datasets


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    from zerobatch.cli._version import __version__

    titles = ", ".join(f.title for f in registry.formats())
    p = _Parser(prog="zerobatch", description=f"Convert, inspect, verify and benchmark zerobatch datasets "
                f"({titles}).")
    p.add_argument("--version", action="version", version=f"zerobatch {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    adders = {"convert": _add_convert, "commit": _add_commit, "inspect": _add_inspect, "verify": _add_verify,
              "head": _add_head, "stats": _add_stats, "bench": _add_bench, "formats": _add_formats,
              "quickstart": _add_quickstart, "trace": add_trace, "plan": add_plan}
    for name, add in adders.items():
        # ``only``: the one command given (its parser alone: ``trace`` starts without building
        # the others, whose options import the preparation modules)
        if only is None or only not in adders or name == only:
            add(sub)
    _describe(sub)
    return p


def _add_convert(sub: Any) -> None:
    s = sub.add_parser("convert", help="convert text or token files into a zerobatch format (or export one to "
                       "Megatron or nanoGPT)")
    s.add_argument("src", nargs="+", help="a file, a folder of files or a glob; a Hugging Face save_to_disk folder; "
                   "a Megatron prefix (.bin or .idx); several text sources of any kinds (JSONL, Parquet, text, HF) "
                   "are read as one, in the order given")
    s.add_argument("dst", help="the file (llmbatch, llmchnk) or folder (tokstream, zrecord) to write")
    from zerobatch.prepare.targets import target_help, targets
    s.add_argument("--to", required=True, choices=targets(), metavar="FORMAT",
                   help=f"what to write ({', '.join(targets())}): {target_help()}")
    s.add_argument("--from", dest="source_kind",
                   choices=("text", "jsonl", "parquet", "hf", "npy", "nanogpt", "megatron", "zerobatch"),
                   help="the source kind (default: from the name; a zerobatch dataset from its bytes)")
    s.add_argument("--tokenizer", help="text sources: a Hugging Face tokenizer.json, tiktoken:NAME (tiktoken:gpt2, "
                   "nanoGPT's) or a SentencePiece .model")
    s.add_argument("--eod-token", help="the end-of-document token appended to each document (default: the "
                   "first of <|endoftext|>, </s>, <eos>, ... the tokenizer has)")
    s.add_argument("--eod-id", type=int, help="the end-of-document id; for flat token files (npy, nanogpt), "
                   "documents end at it")
    s.add_argument("--bos-id", type=int, help="text: start every document with this id")
    s.add_argument("--add-bos", action="store_true", help="text: start every document with the tokenizer's "
                   "beginning-of-document token (<|begin_of_text|>, <s>, ...; Llama and DeepSeek style)")
    s.add_argument("--text-errors", default="replace", choices=("replace", "strict"),
                   help="undecodable text (invalid UTF-8, a lone UTF-16 surrogate in JSON): replace it with "
                   "U+FFFD and count the documents (default), or stop at it naming the file and line")
    s.add_argument("--row-ids", action="store_true", help="text to tokstream or zrecord: keep each document's "
                   "source row (empty and null rows count) as metadata {\"row\": i} / field row")
    s.add_argument("--overwrite", action="store_true", help="replace an existing DST (default: refuse it before "
                   "any work); the old dataset stays readable until the new one is complete")
    s.add_argument("--field", default="text", help="the text field of JSONL, Parquet or HF rows (default text)")
    s.add_argument("--documents", default="file", choices=("file", "line", "blank"),
                   help="plain text: a document per file, per line, or per blank-line-separated block")
    s.add_argument("--split", metavar="WEIGHTS", help="as Megatron's --split: weights such as 969,30,1 cut the "
                   "documents, in order, into DST_train, DST_valid and DST_test (file, line or blank: as "
                   "--documents, release 0.1's spelling)")
    s.add_argument("--hf-split", default="train", help="the split of a saved DatasetDict (default train)")
    s.add_argument("--token-dtype", choices=("uint16", "uint32"), help="nanoGPT .bin token type (default uint16)")
    s.add_argument("--workers", type=_positive, default=max(1, min(8, os.cpu_count() or 1)),
                   help="tokenizer processes (default: the cores, at most 8)")
    s.add_argument("--docs-per-shard", type=_positive, default=1024, help="documents per tokenized group")
    s.add_argument("--seq-len", type=_positive, help="llmbatch: tokens per record (default 512); llmchnk: the "
                   "nominal length, longer documents cut to it")
    s.add_argument("--batch-size", type=_positive, default=32, help="llmbatch: records per batch (default 32)")
    s.add_argument("--seed", type=int, default=42, help="llmbatch: shuffle seed (default 42)")
    s.add_argument("--no-shuffle", action="store_true", help="llmbatch: keep the input order")
    s.add_argument("--shard-tokens", type=_positive, default=DEFAULT_SHARD_TOKENS,
                   help="tokstream: tokens per shard (default 2**28)")
    s.add_argument("--spread", type=int, default=0, choices=range(5), metavar="{0..4}",
                   help="tokstream: spread the shards over 16**N key prefixes (a hex tag before each shard's name) "
                        "so a fleet's requests fall on many partitions of an object store (default 0: none)")
    s.add_argument("--compress", default="raw", choices=("raw", "flate"), help="zrecord: record codec")
    s.add_argument("--vocab-size", type=_positive, help="ids must be below it (default: the tokenizer's, else the "
                   "largest id + 1)")
    s.add_argument("--dtype", default="auto", choices=("auto", "uint16", "uint32"),
                   help="stored token type (auto: uint16 when the vocabulary fits)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.add_argument("--metadata-fields", type=_names, help="text to tokstream: fields of each JSONL record (columns "
                   "of Parquet/HF rows) kept as the document's metadata, comma-separated (e.g. id,url)")
    s.add_argument("--task", type=_nonnegative, help="distributed preparation: this is task I (from 0) of --tasks; "
                   "it writes its share of the inputs as finished parts; then run zerobatch commit DST")
    s.add_argument("--tasks", type=_positive, help="distributed preparation: the number of tasks")
    s.add_argument("--chat", action="store_true", help="JSONL conversations (a 'messages' list of role/content) "
                   "to tokstream: rendered with the --tokenizer folder's chat template, one document per "
                   "conversation, with a per-token loss mask (DST/loss_mask)")
    s.add_argument("--chat-roles", type=_names, help="with --chat: the roles whose tokens are trained on, comma-"
                   "separated (default: assistant)")
    s.add_argument("--unit-bytes", type=_positive, default=64 << 20,
                   help="distributed preparation: bytes of a large JSONL or line-split text file per unit of work "
                   "(default 64 MiB; Parquet files split by row group)")
    s.set_defaults(func=cmd_convert)


def cmd_commit(args: argparse.Namespace) -> int:
    from zerobatch.prepare.tasks import commit

    commit(args.dst, log=print)
    return 0


def _add_commit(sub: Any) -> None:
    s = sub.add_parser("commit", help="assemble the dataset that convert --task/--tasks prepared (after every task)")
    s.add_argument("dst", help="the destination folder (or URL: s3://bucket/dataset) the tasks wrote into")
    s.set_defaults(func=cmd_commit)


def _add_inspect(sub: Any) -> None:
    s = sub.add_parser("inspect", help="print a dataset's header or manifest, counts and sizes")
    s.add_argument("path")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--field", help="zrecord: the token field")
    s.set_defaults(func=cmd_inspect)


def _add_verify(sub: Any) -> None:
    s = sub.add_parser("verify", help="check a whole dataset; exit 1 naming the faulty file and place")
    s.add_argument("path")
    s.add_argument("-q", "--quiet", action="store_true", help="print faults only")
    s.set_defaults(func=cmd_verify)


def _add_head(sub: Any) -> None:
    s = sub.add_parser("head", help="print the first samples (decoded with --tokenizer)")
    s.add_argument("path")
    s.add_argument("-n", type=int, default=3, help="samples to print (default 3)")
    s.add_argument("--tokenizer", help="a tokenizer.json (or a tokenizer folder), tiktoken:NAME or SentencePiece "
                   ".model to decode with; a chat dataset's trained tokens are marked")
    s.add_argument("--field", help="zrecord: the field to print")
    s.add_argument("--chars", type=_positive, default=600, help="decoded characters shown per sample")
    s.add_argument("--full", action="store_true", help="print whole samples")
    s.set_defaults(func=cmd_head)


def _add_stats(sub: Any) -> None:
    s = sub.add_parser("stats", help="token and document-length distributions (--plot: a PNG)")
    s.add_argument("path")
    s.add_argument("--plot", help="write the distributions as a PNG here")
    s.add_argument("--json", action="store_true", help="print the figures as JSON (tokens, counts, length "
                   "percentiles, trained fraction, most frequent ids)")
    s.add_argument("--eod", type=int, help="split documents at this id (formats without document boundaries)")
    s.add_argument("--tokenizer", help="a tokenizer.json (or a tokenizer folder), tiktoken:NAME or SentencePiece "
                   ".model: the most frequent ids shown as decoded text")
    s.add_argument("--top", type=_positive, default=10, help="frequent ids (or features) listed")
    s.add_argument("--field", help="zrecord: the token field")
    s.set_defaults(func=cmd_stats)


def _add_bench(sub: Any) -> None:
    s = sub.add_parser("bench", help="time random batch reads of PATH (no PATH: write a sample .batch file and "
                       "stream epochs from it)")
    s.add_argument("path", nargs="?")
    s.add_argument("--batch-size", type=_positive, default=32)
    s.add_argument("--seq-len", type=_positive, default=512, help="tokens (feature matrices: rows) per sample")
    s.add_argument("--trials", type=_positive, default=5, help="PATH: trials (the median is reported)")
    s.add_argument("--reads", type=_positive, default=2000, help="PATH: batch reads per trial")
    s.add_argument("--field", help="zrecord: the field to read")
    s.add_argument("--records", type=_positive, default=65536, help="sample: records to write (default 65536)")
    s.add_argument("--vocab", type=_positive, default=50257, help="sample: token ids drawn from [0, vocab)")
    s.add_argument("--block-size", type=_positive, default=256)
    s.add_argument("--epochs", type=_positive, default=3)
    s.add_argument("--threads", type=_positive, default=2, help="sample: read-ahead threads")
    s.add_argument("--seed", type=int, default=42)
    s.add_argument("--keep", "--path", dest="keep", metavar="FILE", help="sample: keep the sample file here")
    s.set_defaults(func=cmd_bench)


def _add_formats(sub: Any) -> None:
    s = sub.add_parser("formats", help="list the formats this installation reads and writes")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_formats)


def _add_quickstart(sub: Any) -> None:
    s = sub.add_parser("quickstart", help="train a tokenizer, convert a bundled public-domain text and train a tiny "
                       "causal LM through the zerobatch loader (CPU, under a minute on 2 cores)")
    s.add_argument("--steps", type=_positive, default=300, help="training steps (default 300)")
    s.add_argument("--workdir", help="keep the tokenizer and datasets here (default: a temporary folder)")
    s.add_argument("--vocab", type=_positive, default=2048, help="tokenizer vocabulary (default 2048)")
    s.add_argument("--seq-len", type=_positive, default=128)
    s.add_argument("--batch-size", type=_positive, default=16)
    s.add_argument("--text", help="train on this text file instead of the bundled one")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=cmd_quickstart)


def _shown(path: str) -> str:
    """A path as printed: a URL without user information or query string."""
    from zerobatch.core.remote import is_url, redact
    return redact(path) if is_url(path) else path


def _check_urls(args: argparse.Namespace) -> None:
    """Refuse, before any work, a URL argument with credentials in it (``s3://KEY:SECRET@b``)
    or without a valid bucket or host: the message quotes no part of it."""
    from zerobatch.core.remote import check_url, is_url
    for name, value in vars(args).items():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str) and is_url(v):
                check_url(v, field=name)


#: The exit status when the reader of stdout goes away (``zerobatch stats X | head -2``): what
#: a shell reports for a tool that SIGPIPE ended (128 + 13), as ``cat`` and ``yes`` give.
EXIT_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    A closed stdout (the reader of a pipe went away) ends every command quietly with
    :data:`EXIT_PIPE`, nothing on stderr, as Python's note on SIGPIPE recommends: stdout is
    pointed at the null device so that the interpreter's last flush cannot fail again.
    """
    try:
        try:
            return _main(argv)
        finally:        # output still buffered is written here, where a closed pipe is caught
            if sys.stdout is not None:
                sys.stdout.flush()
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_PIPE


def _stdout_to_devnull() -> None:
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):     # replaced by an object without a descriptor
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _main(argv: Sequence[str] | None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(only=given[0] if given[:1] in (["trace"], ["plan"]) else None).parse_args(argv)
    try:
        _check_urls(args)
        return int(args.func(args))
    except SystemExit as exc:
        return int(exc.code or 0)
    except ZerobatchError as exc:
        print(f"zerobatch {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # stdout closed: no error of the command (main ends it quietly)
        raise
    except OSError as exc:   # a full disk, a permission, a read error outside the readers
        where = f"{exc.filename}: " if exc.filename else ""
        print(scrub(f"zerobatch {args.command}: error: {where}{exc.strerror or exc}"), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"zerobatch {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: still one line, the traceback on request
        if os.environ.get("ZEROBATCH_DEBUG"):
            raise
        print(scrub(f"zerobatch {args.command}: internal error: {type(exc).__name__}: {exc}")
              + " (ZEROBATCH_DEBUG=1 shows the traceback; please report it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

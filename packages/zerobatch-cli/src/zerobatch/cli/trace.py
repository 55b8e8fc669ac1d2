"""``zerobatch trace``: which documents a training step saw, and at which steps a document was
seen, from a run card (:mod:`zerobatch.adapters.provenance`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from zerobatch.formats.errors import ConfigError

__all__ = ["add_trace", "cmd_trace"]

HELP = ("Answer from a run card (loader.describe(), saved with a checkpoint; a checkpoint folder or a trainer's JSON "
        "holding one will do) what global step N held on every rank (--step: per row, the source, the documents, "
        "their token ranges, which part of each, their metadata, the text with --tokenizer), or every step, rank "
        "and row where a document's tokens entered training (--document, by index, by a metadata field with --by, "
        "or by a token position with --token; --documents FILE for many). No token is read without --text.",
        "zerobatch trace ckpt/zerobatch_run_card.json --step 1200 --tokenizer tokenizer.json --text")


def add_trace(sub: Any) -> None:
    s = sub.add_parser("trace", help="which documents a step saw, and when a document was seen (from a run card)")
    s.add_argument("card", help="a run card (JSON file), or a checkpoint folder holding zerobatch_run_card.json")
    what = s.add_mutually_exclusive_group(required=True)
    what.add_argument("--step", type=int, help="the global step to describe (the loader's steps from the start)")
    what.add_argument("--document", help="a document: its index, or with --by the value of a metadata field")
    what.add_argument("--token", type=int, help="the document holding this global token position")
    what.add_argument("--documents", metavar="FILE", help="many documents: one index (or --by value) a line")
    s.add_argument("--rank", type=int, help="--step: this rank only")
    s.add_argument("--source", help="a mixture's source the documents belong to (by its name)")
    s.add_argument("--by", metavar="FIELD", help="find documents by this metadata field (id, url, row of --row-ids)")
    s.add_argument("--until", type=int, help="look up to this step (default: the card's state, else one epoch)")
    s.add_argument("--tokenizer", help="decode each row's tokens to text (with --text)")
    s.add_argument("--text", action="store_true", help="--step: print each document piece's text (reads tokens)")
    s.add_argument("--no-metadata", action="store_true", help="--step: leave the documents' metadata out")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_trace)


def cmd_trace(args: argparse.Namespace) -> int:
    from zerobatch.adapters.provenance import find_documents
    from zerobatch.adapters.trace import Trace

    if args.text and not args.tokenizer:
        raise ConfigError("--text needs --tokenizer", field="tokenizer")
    with Trace(args.card) as trace:
        if args.step is not None:
            out = trace.step(args.step, args.rank, metadata=not args.no_metadata)
            if args.text:
                _add_text(trace, out, args.tokenizer)
            _print_step(out, args.json)
            return 0
        units = trace.units(args.source)
        if args.token is not None:
            if not 0 <= args.token < getattr(units, "num_tokens", 2**63):
                raise ConfigError(f"--token {args.token} is outside the dataset", field="token")
            docs = [int(units.documents_at([args.token])[0])]
            names: list[Any] = docs
        else:
            values = [args.document] if args.document is not None else _lines(args.documents)
            if args.by:
                found = find_documents(units, args.by, values)
                missing = [v for v, d in found.items() if not d]
                if missing and args.document is not None:
                    raise ConfigError(f"no document has {args.by} {missing[0]!r}", field="by")
                docs = [d for v in values for d in found.get(v, [])]
                names = [v for v in values for _ in found.get(v, [])]
                if missing:
                    print(f"zerobatch trace: {len(missing)} of {len(values)} {args.by} values are in no document",
                          file=sys.stderr)
            else:
                try:
                    docs = [int(v) for v in values]
                except ValueError:
                    raise ConfigError("a document is an index (give --by FIELD to find documents by metadata)",
                                      field="document") from None
                names = docs
        seen = trace.documents(docs, source=args.source, until=args.until)
        _print_documents(names, docs, seen, args.json, trace)
    return 0


def _lines(path: str) -> list[str]:
    if not os.path.exists(path):
        raise ConfigError("no such file", path=path, field="documents")
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def _add_text(trace: Any, out: dict[str, Any], tokenizer: str) -> None:
    from zerobatch.prepare.tokenizer import load_tokenizer
    tok = load_tokenizer(tokenizer)
    for rank in out["ranks"]:
        for row in rank["rows"]:
            units = trace.units(row["source"])
            for piece in row["documents"]:
                a, b = piece["tokens"]
                piece["text"] = tok.decode(trace.tokens(units, a, b).tolist())


def _print_step(out: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(out, ensure_ascii=False))
        return
    epoch = f" (epoch {out['epoch']}, step {out['epoch_step']} of it)" if "epoch" in out else ""
    print(f"step {out['step']}{epoch}: {out['world_size']} ranks" + (", skipped (excluded)" if out["skipped"] else ""))
    for rank in out["ranks"]:
        print(f"rank {rank['rank']}: {len(rank['rows'])} rows")
        for row in rank["rows"]:
            where = f" {row['source']}" if row["source"] is not None else ""
            print(f"  row {row['row']}{where} (item {row['item']})")
            for p in row["documents"]:
                (a, b), (s0, s1) = p["tokens"], p["document_tokens"]
                meta = f" {json.dumps(p['metadata'], ensure_ascii=False)}" if "metadata" in p else ""
                print(f"    at {p['row_offset']}: document {p['document']} tokens {a}:{b} "
                      f"({b - a} of its {s1 - s0}, from its token {p['offset']}){meta}")
                if "text" in p:
                    print("      " + p["text"].replace("\n", "\n      "))


def _print_documents(names: list[Any], docs: list[int], seen: list[list[dict[str, Any]]], as_json: bool,
                     trace: Any) -> None:
    if as_json:
        print(json.dumps([{"query": n, "document": d, "seen": s} for n, d, s in zip(names, docs, seen, strict=True)],
                         ensure_ascii=False))
        return
    for n, d, recs in zip(names, docs, seen, strict=True):
        label = f"document {d}" if n == d else f"{n!r} (document {d})"
        steps = sorted({r["step"] for r in recs})
        print(f"{label}: seen at {len(steps)} steps, {len(recs)} rows")
        for r in recs:
            epoch = "" if r.get("epoch") is None else f" (epoch {r['epoch']})"
            src = f" {r['source']}" if "source" in r else ""
            a, b = r["tokens"]
            print(f"  step {r['step']}{epoch} rank {r['rank']} row {r['row']}{src}: its tokens {a}:{b} at row offset "
                  f"{r['row_offset']}")

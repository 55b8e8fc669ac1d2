"""Confirm or dismiss a slowdown the asv regression gate reported, from the fastest sample.

``asv continuous`` compares medians. On a shared 2-core machine a microsecond benchmark's
median doubles for a whole process now and then (one run of the same commit twice gave
8.5 and 16.5 us for one parameter set), while the fastest of its samples stays within a few
percent: noise only ever adds time, so the minimum is the estimator a contended machine
cannot inflate (``timeit``'s documentation makes the same point). After the gate reruns the
suspects, both commits interleaved round by round, this script compares, for every
parameter set of the named benchmarks, the fastest sample of the new commit with the
fastest of the previous one, and exits 1 if any is more than ``--factor`` times slower.
Benchmarks without timing samples (``track_*``, ``peakmem_*``) compare their values.

    python tools/asv_confirm.py --config asv_bench/asv.conf.json --factor 2.0 \\
        --regex '^bench_tokstream\\.Windows\\.' BASE_SHA HEAD_SHA
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import re
import sys


def _fastest(results, key: str) -> dict[tuple, float]:
    """The fastest sample (or, without samples, the value) per parameter combination."""
    params = results.get_result_params(key)
    values = results.get_result_value(key, params)
    samples = results.get_result_samples(key, params) or [None] * len(values)
    combos = list(itertools.product(*params)) if params else [()]
    out = {}
    for combo, value, sample in zip(combos, values, samples, strict=True):
        if sample:
            out[combo] = min(sample)
        elif value is not None and not (isinstance(value, float) and math.isnan(value)):
            out[combo] = value
    return out


def _load(conf, machine: str, commit: str) -> dict[str, object]:
    from asv import results as asv_results

    found = {}
    for res in asv_results.iter_results_for_machine_and_hash(conf.results_dir, machine, commit):
        for key in res.get_all_result_keys():
            found[key] = res
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base")
    parser.add_argument("head")
    parser.add_argument("--config", default="asv.conf.json")
    parser.add_argument("--regex", required=True, help="the benchmarks to compare (asv's -b expression)")
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--machine", default=None, help="asv machine name (default: the only one)")
    args = parser.parse_args(argv)

    from asv import config as asv_config

    conf = asv_config.Config.load(args.config)
    machine = args.machine
    if machine is None:
        names = [d for d in os.listdir(conf.results_dir) if os.path.isdir(os.path.join(conf.results_dir, d))]
        if len(names) != 1:
            print(f"asv_confirm: name the machine (--machine), results hold {names}", file=sys.stderr)
            return 2
        machine = names[0]
    base, head = _load(conf, machine, args.base), _load(conf, machine, args.head)
    pattern = re.compile(args.regex)
    keys = sorted(k for k in set(base) & set(head) if pattern.search(k))
    if not keys:
        print(f"asv_confirm: no results of {args.regex!r} for both commits", file=sys.stderr)
        return 2
    status = 0
    print(f"{'fastest before':>16} {'fastest after':>16} {'ratio':>7}  benchmark")
    for key in keys:
        before, after = _fastest(base[key], key), _fastest(head[key], key)
        for combo in sorted(set(before) | set(after)):
            name = f"{key}({', '.join(combo)})" if combo else key
            if combo not in after:
                print(f"{'':>16} {'failed':>16} {'':>7}  {name}")
                status = 1
                continue
            if combo not in before:
                continue
            a, b = before[combo], after[combo]
            ratio = b / a if a else math.inf
            mark = " +" if ratio > args.factor else "  "
            print(f"{a:16.6g} {b:16.6g} {ratio:7.2f}{mark}{name}")
            if ratio > args.factor:
                status = 1
    print("slower beyond the factor, by the fastest sample" if status else "no slowdown beyond the factor by the fastest sample")
    return status


if __name__ == "__main__":
    sys.exit(main())

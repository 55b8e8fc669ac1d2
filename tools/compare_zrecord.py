"""ZRECORD random gathers against Google's ArrayRecord, in one run on this machine.

The same records (random bytes for ``raw``, compressible runs for ``flate``) go into a
ZRECORD store (one variable-length ``bytes`` field) and an ArrayRecord file
(``group_size:1``; uncompressed for raw, its default compression for flate). Each side then
reads the same random batches, page cache warm:

- zerobatch: ``store.gather(indices)`` then ``release()``; raw records are zero-copy views,
  flate records are inflated into one buffer; checksums verified (``verify=True``, the
  default) and, for the zero-copy cost, also without;
- ArrayRecord: ``reader.read(indices)`` (a list of ``bytes``), serial
  (``max_parallelism:0``) and on its thread pool (``max_parallelism:2``); the faster of the
  two is the reference.

Prints records/s per case, the ratio zerobatch / ArrayRecord (best of each side's thread
settings) and the zero-copy path's cost per record. Usage::

    python tools/compare_zrecord.py [--repeat 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter  # noqa: E402

from zerobatch.formats.zrecord import FieldSpec  # noqa: E402
from zerobatch.readers.zrecord import ZRecordStore  # noqa: E402
from zerobatch.writers.zrecord import ZRecordWriter  # noqa: E402

SIZES = {256: 1 << 16, 4096: 1 << 13, 65536: 1 << 10}
AR_WRITE = {"raw": "group_size:1,uncompressed", "flate": "group_size:1"}
AR_READ = {1: "readahead_buffer_size:0,max_parallelism:0", 2: "readahead_buffer_size:0,max_parallelism:2"}


def records(size: int, n: int, codec: str) -> list[bytes]:
    rng = np.random.default_rng(size)
    if codec == "raw":
        data = rng.integers(0, 256, (n, size), dtype=np.uint8)
    else:
        data = np.repeat(rng.integers(0, 16, (n, size // 8), dtype=np.uint8), 8, axis=1)
    return [row.tobytes() for row in data]


def best(fn, batches, repeat: int) -> float:
    """Seconds per batch: the best of ``repeat`` passes over every batch."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for b in batches:
            fn(b)
        times.append((time.perf_counter() - t0) / len(batches))
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="zb-compare-zrecord-")
    rows = []
    try:
        for size, n in SIZES.items():
            for codec in ("raw", "flate"):
                recs = records(size, n, codec)
                zpath, apath = os.path.join(folder, f"zr-{size}-{codec}"), os.path.join(folder, f"ar-{size}-{codec}")
                with ZRecordWriter(zpath, [FieldSpec("x", "bytes", None, codec)], chunk_size=1 << 14) as w:
                    w.extend(recs)
                ar = ArrayRecordWriter(apath, AR_WRITE[codec])
                for r in recs:
                    ar.write(r)
                ar.close()
                for batch in (32, 256):
                    idx = [np.random.default_rng(k).integers(0, n, batch) for k in range(32)]
                    lists = [i.tolist() for i in idx]
                    row = {"record_bytes": size, "codec": codec, "batch": batch}
                    for threads in (1, 2):
                        with ZRecordStore(zpath, num_threads=threads) as s:
                            for i in idx:
                                s.gather(i).release()
                            row[f"zb_{threads}"] = best(lambda i, s=s: s.gather(i).release(), idx, args.repeat)
                        reader = ArrayRecordReader(apath, AR_READ[threads])
                        for lst in lists:
                            reader.read(lst)
                        row[f"ar_{threads}"] = best(reader.read, lists, args.repeat)
                        reader.close()
                    if codec == "raw":
                        with ZRecordStore(zpath, num_threads=1, verify=False) as s:
                            for i in idx:
                                s.gather(i).release()
                            row["zb_noverify"] = best(lambda i, s=s: s.gather(i).release(), idx, args.repeat)
                    zb = min(row["zb_1"], row["zb_2"])
                    ar_best = min(row["ar_1"], row["ar_2"])
                    row["ratio"] = ar_best / zb
                    rows.append(row)
                    extra = ""
                    if codec == "raw":
                        extra = (f"  per record: {row['zb_1'] / batch * 1e9:6.0f} ns checked, "
                                 f"{row['zb_noverify'] / batch * 1e9:6.0f} ns unchecked")
                    print(f"{size:6d} B {codec:5s} x{batch:3d}: zerobatch {batch / row['zb_1']:10,.0f} rec/s (1 thread) "
                          f"{batch / row['zb_2']:10,.0f} (2) | ArrayRecord {batch / row['ar_1']:10,.0f} (serial) "
                          f"{batch / row['ar_2']:10,.0f} (pool) | zerobatch / ArrayRecord {row['ratio']:5.2f}x"
                          + extra, flush=True)
                shutil.rmtree(zpath)
                os.unlink(apath)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for codec in ("raw", "flate"):
        r = [x["ratio"] for x in rows if x["codec"] == codec]
        print(f"{codec}: zerobatch / ArrayRecord from {min(r):.2f}x to {max(r):.2f}x (geometric mean "
              f"{float(np.exp(np.mean(np.log(r)))):.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""Feature matrices on the command line: their face for ``inspect`` / ``verify`` / ``head`` /
``stats`` / ``bench`` (they are not a ``convert`` target: they hold floats, not tokens)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
from zerobatch.cli.datasets import Dataset, Progress, dist, folder_size, human, pyplot, summary
from zerobatch.formats.errors import CorruptError

__all__ = ["Features"]


class Features(Dataset):
    kind = "features"
    tokens = False

    def __init__(self, path: str, field: str | None = None) -> None:
        super().__init__(path)
        from zerobatch.readers.features import FeatureMatrix

        self.r = FeatureMatrix(path, 1)

    def info(self) -> list[tuple[str, Any]]:
        m = self.r.meta
        size = folder_size(self.path)
        return [
            ("format", "flat feature matrix"), ("rows", m.num_rows), ("features", m.num_features),
            ("dtype", m.dtype), ("keys", len(m.keys)),
            ("normalization", "mean/std per feature" if m.mean is not None else "none"),
            ("columns", ", ".join(m.columns) if getattr(m, "columns", None) else "unnamed"),
            ("checksums", f"XXH3-64 per {human(m.block_bytes)} block + metadata_xxh3"),
            ("build_id", m.build_id), ("size", f"{size} ({human(size)})"),
        ]

    def verify(self, progress: Progress | None) -> tuple[list[str], str]:
        self.r.verify()
        return [], f"{self.r.meta.num_rows} rows x {self.r.meta.num_features}: metadata and every block verified"

    def sample_name(self) -> str:
        return "row"

    def samples(self, n: int) -> list[np.ndarray]:
        return [np.array(self.r.matrix[i]) for i in range(min(n, self.r.num_rows))]

    def lengths(self) -> np.ndarray:
        return (self.r.key_stops - self.r.key_starts).astype(np.int64)

    def batch_reader(self, batch_size: int, seq_len: int, rng: np.random.Generator
                     ) -> tuple[Callable[[], Any], int, int]:
        from zerobatch.readers.features import FeatureMatrix

        fm = FeatureMatrix(self.path, seq_len)
        total = int(fm.key_windows.sum())
        if total == 0:
            raise CorruptError(f"bench: no key has {seq_len} rows (use --seq-len)", path=self.path, field="seq_len")
        out = np.empty((batch_size, seq_len, fm.num_features), fm.meta.np_dtype)

        def read() -> Any:
            return fm.windows(rng.integers(0, total, batch_size), out=out)
        return read, max(1, total // batch_size), batch_size * seq_len

    def close(self) -> None:
        pass

    def print_value_stats(self, path: str, *, top: int, plot: str | None, as_json: bool = False) -> int:
        ds = self
        m = ds.r.matrix
        if not as_json:
            print(f"rows: {m.shape[0]:,}  features: {m.shape[1]}  keys: {len(ds.r.meta.keys)}")
            print(dist("key lengths (rows each)", ds.lengths()))
        out: dict[str, Any] = {"path": path, "format": self.kind.upper(), "rows": int(m.shape[0]),
                               "features": int(m.shape[1]), "keys": len(ds.r.meta.keys),
                               "lengths": {"of": "keys (rows each)", **summary(ds.lengths())}, "values": []}
        if m.shape[0]:
            lo = np.full(m.shape[1], np.inf)
            hi = np.full(m.shape[1], -np.inf)
            s = np.zeros(m.shape[1])
            s2 = np.zeros(m.shape[1])
            for a in range(0, m.shape[0], 65536):
                blk = m[a:a + 65536].astype(np.float64)
                lo, hi = np.minimum(lo, blk.min(0)), np.maximum(hi, blk.max(0))
                s += blk.sum(0)
                s2 += (blk * blk).sum(0)
            mean = s / m.shape[0]
            std = np.sqrt(np.maximum(s2 / m.shape[0] - mean * mean, 0))
            names = ds.r.meta.columns or [f"f{j}" for j in range(m.shape[1])]
            out["values"] = [{"feature": names[j], "mean": float(mean[j]), "std": float(std[j]), "min": float(lo[j]),
                              "max": float(hi[j])} for j in range(min(m.shape[1], top))]
            if not as_json:
                print(f"{'feature':<16} {'mean':>10} {'std':>10} {'min':>10} {'max':>10}   (stored values)")
                for j in range(min(m.shape[1], top)):
                    print(f"{names[j][:16]:<16} {mean[j]:>10.4f} {std[j]:>10.4f} {lo[j]:>10.4f} {hi[j]:>10.4f}")
            if plot:
                plt = pyplot()
                fig, ax = plt.subplots(1, 2, figsize=(11, 4))
                ax[0].hist(ds.lengths(), bins=50)
                ax[0].set(title="rows per key", xlabel="rows", ylabel="keys")
                ax[1].errorbar(np.arange(m.shape[1]), mean, yerr=std, fmt="o", ms=3)
                ax[1].set(title="stored values: mean +- std per feature", xlabel="feature")
                fig.suptitle(path)
                fig.tight_layout()
                try:
                    fig.savefig(plot, dpi=110)
                finally:
                    plt.close(fig)
                if as_json:
                    out["plot"] = plot
                else:
                    print(f"wrote {plot}")
        if as_json:
            print(json.dumps(out, indent=2))
        return 0

"""torchtitan adapter: zerobatch data as torchtitan's dataloader (tested with torchtitan 0.3.0).

torchtitan 0.3.0 builds its dataloader from ``Trainer.Config.dataloader``, a
``BaseDataLoader.Config``: the trainer calls ``config.dataloader.build(dp_world_size=,
dp_rank=, tokenizer=, seq_len=, local_batch_size=, snapshot_every_n_steps=)``, iterates the
result for ``(input_dict, labels)`` pairs (``input_dict["input"]``, optionally
``input_dict["positions"]``), and its DCP ``CheckpointManager`` saves it as a ``Stateful``
under the ``"dataloader"`` key of every checkpoint and restores it before the first step.
That config / ``Stateful`` pair is the hook: it is what torchtitan's own text and chat loaders
plug into (0.3.0 has no Grain data path), and swapping the config is all a user does.

:class:`ZerobatchDataLoader` is a ``BaseDataLoader`` over a zerobatch
:class:`~zerobatch.adapters.torch.Loader` of a TOKSTREAM dataset: each rank of the
data-parallel mesh reads its share of each global step with no communication, and its state
is zerobatch's, the same on every rank. It is saved under one key, ``"zerobatch"`` (DCP keeps
one copy of a key that every rank saves), not per rank as torchtitan's
``ParallelAwareDataloader`` does (``dp_rank_<r>``, refused on another data-parallel degree):
so a checkpoint resumes on any number of data-parallel ranks, exactly in the uninterrupted
order when the global batch is the same (zerobatch's resume rule).

Example::

    from zerobatch.adapters.torchtitan import ZerobatchDataLoader

    config.dataloader = ZerobatchDataLoader.Config(dataset_path="/data/corpus", seed=1234)

Importing this module imports torchtitan (and torch); :mod:`zerobatch.adapters` itself never
does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

try:
    from torchtitan.components.dataloader import BaseDataLoader
except ImportError as exc:  # pragma: no cover - exercised only without torchtitan
    raise ImportError("zerobatch.adapters.torchtitan needs torchtitan: pip install 'zerobatch-adapters[torchtitan]'") from exc

from zerobatch.adapters._loader import DEFAULT_PREFETCH, DEFAULT_SEED
from zerobatch.adapters.sources import PackedDocuments, TokenWindows
from zerobatch.adapters.torch import Loader
from zerobatch.formats.errors import ConfigError, StateError

__all__ = ["KINDS", "STATE_KEY", "ZerobatchDataLoader"]

#: The key of the loader's state (a JSON string) in the dataloader's ``state_dict``.
STATE_KEY = "zerobatch"
#: How the dataset is cut into rows (``ZerobatchDataLoader.Config.kind``).
KINDS = ("windows", "packed")


class ZerobatchDataLoader(BaseDataLoader):
    """torchtitan's dataloader over a TOKSTREAM dataset, read by zerobatch.

    Each batch is ``({"input": int64 [B, seq_len], "positions": int64 [B, seq_len]}, labels)``
    (``positions`` unless ``Config.positions`` is off): the positions restart at 0 at each
    document start, as torchtitan's own text loader hands them out (its attention masks and
    RoPE read them).

    Args:
        config: the :class:`Config`.
        dp_world_size, dp_rank: the data-parallel degree and this rank's place in it (the
            trainer's batch mesh).
        seq_len: tokens per row.
        local_batch_size: rows per batch on this rank (the trainer's micro-batch).
        tokenizer, snapshot_every_n_steps: what the trainer passes to every dataloader;
            unused (the data is tokenized already, and the state is exact at every step).

    Raises:
        ConfigError: no ``dataset_path``, an unknown ``kind``, or what the zerobatch source
            and loader refuse (a path of another format, a batch larger than the data...).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = "zerobatch"
        """A name for logs (the data is ``dataset_path``)."""

        kind: str = "windows"
        """``"windows"``: consecutive ``seq_len`` tokens of the stream, every token a target
        once (labels run across document ends); ``"packed"``: whole documents packed into
        rows (``PackedDocuments``, best fit), labels ``-100`` across documents and on
        padding."""

        seed: int = DEFAULT_SEED
        """The shuffle's seed (a Feistel permutation of all rows, a new one each epoch)."""

        positions: bool = True
        """Hand out ``positions`` (per document) with the inputs."""

        loss_mask: bool = False
        """Labels ``-100`` where the dataset's loss mask (``convert --chat``) is off."""

        infinite: bool = True
        """Epoch after epoch; ``False``: stop at the end of the current epoch."""

        prefetch: int = DEFAULT_PREFETCH
        """Steps read ahead (by threads of the training process)."""

        num_threads: int | None = None
        """Read-ahead threads (default: CPUs - 1, at most 2)."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, seq_len: int, local_batch_size: int,
                 tokenizer: Any = None, snapshot_every_n_steps: int | None = None, **kwargs: Any) -> None:
        del tokenizer, snapshot_every_n_steps, kwargs
        if not config.dataset_path:
            raise ConfigError("dataset_path: give the TOKSTREAM dataset's folder (or URL)", field="dataset_path")
        if config.kind not in KINDS:
            raise ConfigError(f"kind must be one of {KINDS}, got {config.kind!r}", field="kind")
        self.config = config
        if config.kind == "windows":
            source: Any = TokenWindows(config.dataset_path, seq_len=seq_len, boundaries=config.positions,
                                       loss_mask=config.loss_mask)
        else:
            source = PackedDocuments(config.dataset_path, seq_len=seq_len, loss_mask=config.loss_mask,
                                     cu_seqlens=False, layout="next-token")
        self.loader = Loader(source, batch_size=local_batch_size, seed=config.seed, rank=dp_rank,
                             world_size=dp_world_size, prefetch=config.prefetch, num_threads=config.num_threads)
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            for batch in self.loader:
                yield self._titan(batch)
            if self.loader.endless or not self.config.infinite:
                return
            self.loader.set_epoch(self.loader.epoch + 1)

    def _titan(self, batch: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """A zerobatch batch as torchtitan's ``(input_dict, labels)``."""
        if isinstance(batch, tuple):
            x, y = batch
            return {"input": x}, y
        inputs = {"input": batch["input_ids"]}
        if self.config.positions:
            inputs["positions"] = batch["position_ids"]
        return inputs, batch["labels"]

    def state_dict(self) -> dict[str, Any]:
        """``{"zerobatch": <the loader's state as JSON>}``: the position after the last batch
        the trainer took, the same on every rank (one string, which DCP saves once)."""
        return {STATE_KEY: json.dumps(self.loader.state_dict(), sort_keys=True)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue after the last batch of the run that saved ``state_dict``, on any number
        of data-parallel ranks. An empty state (a checkpoint without the dataloader) is
        ignored, as torchtitan's loaders do.

        Raises:
            StateError: a state of another dataloader (torchtitan's ``dp_rank_<r>`` ones), or
                one the zerobatch loader refuses (another dataset, seed, ``seq_len``...).
        """
        if not state_dict:
            return
        if STATE_KEY not in state_dict:
            raise StateError(f"not a zerobatch dataloader state (no {STATE_KEY!r} key; it has "
                             f"{sorted(state_dict)[:4]}): the checkpoint was saved with another dataloader",
                             field="dataloader")
        raw = state_dict[STATE_KEY]
        try:
            state = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
        except ValueError:
            raise StateError("the zerobatch dataloader state is not JSON", field="dataloader") from None
        self.loader.load_state_dict(state)

    def close(self) -> None:
        """Stop read-ahead and release the dataset's files."""
        self.loader.close()

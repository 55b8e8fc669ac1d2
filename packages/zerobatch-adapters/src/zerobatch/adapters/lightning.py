"""PyTorch Lightning adapter: zerobatch data in ``Trainer.fit``, resumed exactly from
Lightning's own checkpoint.

Example::

    from zerobatch.adapters.lightning import ZerobatchDataModule
    from zerobatch.adapters.torch import TokenWindows

    data = ZerobatchDataModule(TokenWindows("data/tokens", seq_len=2048), global_batch_size=64, seed=1)
    checkpoints = ModelCheckpoint(every_n_train_steps=500, save_last=True)
    trainer = L.Trainer(max_steps=10_000, callbacks=[checkpoints])
    trainer.fit(model, datamodule=data, ckpt_path="last")   # after a crash: goes on with the next batch

:class:`ZerobatchDataModule` builds a :class:`zerobatch.adapters.torch.Loader` for this rank
and puts its position into every checkpoint Lightning writes. Fabric needs no adapter: the
loader is an object with ``state_dict`` / ``load_state_dict``, which ``fabric.save`` and
``fabric.load`` save and restore as they do a model (docs/trainers/lightning.md).

The hooks it uses, and why each is the stable one (tested with lightning 2.6.6):

- ``LightningDataModule.state_dict`` / ``load_state_dict``: Lightning stores the datamodule's
  state in every checkpoint (under the class's qualified name) and hands it back before it
  asks for the train dataloader, whatever the point of the run the checkpoint was taken at.
  (The fit loop also saves the state of a train loader that has ``state_dict``, but restores
  it only while ``FitLoop.restarting``, which is False after a checkpoint taken at the end of
  an epoch of a run bounded by ``max_epochs``.)
- ``Callback.on_train_batch_start``: called once for every batch the loop hands the model,
  after the data fetcher's read-ahead. For a loader without a length (a mixture, an endless
  order) Lightning's ``_PrefetchDataFetcher`` holds one batch more than the model received,
  so the loader's own state would be one batch ahead in every checkpoint; Lightning does not
  compensate. The datamodule adds a small callback of its own to ``trainer.callbacks`` and
  saves the position after the last batch the model *received*.
- ``sampler.set_epoch``: Lightning calls ``set_epoch(epoch)`` on a train dataloader's
  ``sampler`` at the start of every epoch, a resumed one included (how ``DistributedSampler``
  gets a new shuffle). The datamodule's dataloader is its own ``sampler`` and starts that
  epoch at its next pass. Without it a loader handed to ``trainer.fit`` directly would start
  its second epoch where the first ended (an empty epoch) and its third as a repeat of the
  first.
- ``train_dataloader``: called once the process group is up, so the loader is built there
  for ``trainer.global_rank`` of ``trainer.world_size``. What it returns is not a torch
  ``DataLoader``: Lightning neither injects a ``DistributedSampler`` nor re-creates it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
except ImportError as exc:  # pragma: no cover - exercised only without Lightning
    raise ImportError("zerobatch.adapters.lightning needs Lightning: "
                      "pip install 'zerobatch-adapters[lightning]'") from exc

from zerobatch.adapters.torch import Loader
from zerobatch.formats.errors import ConfigError, StateError

__all__ = ["STATE_KEY", "TrainLoader", "ZerobatchDataModule"]

#: the key of the loader's state in :meth:`ZerobatchDataModule.state_dict`
STATE_KEY = "loader"


class _ReceivedBatches(pl.Callback):
    """Tells its datamodule each time the training loop hands the model a batch."""

    def __init__(self, owner: ZerobatchDataModule) -> None:
        self.owner = owner

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        # (trainer.datamodule and trainer.callbacks are set by Lightning's connectors: public,
        # undeclared)
        if trainer.datamodule is self.owner:  # type: ignore[attr-defined]
            self.owner._received_one()


class TrainLoader:
    """The train dataloader of a :class:`ZerobatchDataModule` (what ``trainer.train_dataloader``
    is): its loader, one pass per epoch.

    Lightning sets the epoch through :attr:`sampler` (``set_epoch`` at the start of every
    epoch); a pass starts that epoch unless the loader already stands in it. ``len`` is the
    loader's steps per epoch (a ``TypeError`` for an endless loader, which Lightning reads as
    "no length"). ``state_dict`` / ``load_state_dict`` are the datamodule's, so Lightning's
    fit loop counts the loader as resumable and keeps a copy of its position too.
    """

    def __init__(self, owner: ZerobatchDataModule) -> None:
        self.owner = owner

    @property
    def loader(self) -> Loader:
        """The zerobatch loader."""
        return self.owner.loader  # type: ignore[return-value]

    @property
    def sampler(self) -> TrainLoader:
        """Itself: Lightning calls ``sampler.set_epoch(epoch)`` at the start of every epoch."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at the next pass (an endless loader has no epochs: ignored)."""
        self.owner._epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return self.owner._pass()

    def state_dict(self) -> dict[str, Any]:
        """The datamodule's :meth:`~ZerobatchDataModule.state_dict`."""
        return self.owner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The datamodule's :meth:`~ZerobatchDataModule.load_state_dict`."""
        self.owner.load_state_dict(state)


class ZerobatchDataModule(pl.LightningDataModule):
    """A ``LightningDataModule`` whose train dataloader is a zerobatch loader, with its
    position in every Lightning checkpoint.

    Args:
        source: a zerobatch source (``TokenWindows``, ``TokenDocuments``, ``PackedDocuments``,
            ``Mixture``, a ``.batch`` path...), or a ready
            :class:`~zerobatch.adapters.torch.Loader` built for the trainer's rank (then no
            other argument).
        **loader_kwargs: :class:`~zerobatch.adapters.torch.Loader`'s arguments
            (``global_batch_size`` or ``batch_size``, ``seed``, ``shuffle``, ``tail``,
            ``dtype``, ``pin_memory``...), except ``rank`` and ``world_size``, which come from
            the trainer.

    The loader is built by :meth:`train_dataloader`, when Lightning asks for it (the process
    group is up by then), for ``trainer.global_rank`` of ``trainer.world_size``.
    :meth:`state_dict` is ``{"loader": <the loader's state after the last batch the model
    received>}``; Lightning saves it in each checkpoint under ``"ZerobatchDataModule"`` (the
    class's qualified name) and hands it to :meth:`load_state_dict` on
    ``trainer.fit(..., ckpt_path=...)``. The state resumes on any world size: with the same
    global batch the run continues exactly as the uninterrupted run would.

    Give ``global_batch_size`` (``batch_size`` is per rank) to keep the global batch when a
    run resumes on another number of processes. For validation, subclass and add
    ``val_dataloader``.

    Raises:
        ConfigError: ``rank`` or ``world_size`` among the arguments; arguments with a ready
            loader; (at ``fit``) a ready loader built for another rank than the trainer's, or
            a ``training_step`` that takes ``dataloader_iter`` (it fetches batches itself, so
            which one the model received is not known).
    """

    def __init__(self, source: Any, **loader_kwargs: Any) -> None:
        super().__init__()
        for key in ("rank", "world_size"):
            if key in loader_kwargs:
                raise ConfigError(f"ZerobatchDataModule: {key} comes from the trainer (trainer.global_rank, "
                                  f"trainer.world_size); do not pass it", field=key)
        self.loader: Loader | None = None
        if isinstance(source, Loader):
            if loader_kwargs:
                raise ConfigError(f"ZerobatchDataModule: a ready Loader takes no loader arguments, got "
                                  f"{sorted(loader_kwargs)}", field=sorted(loader_kwargs)[0])
            self.loader = source
        self.source = source
        self.loader_kwargs = loader_kwargs
        self._epoch: int | None = None
        # the loader's state after the last batch the model received (None: where the loader
        # stands), and after each batch read for the loop and not yet received (Lightning's
        # read-ahead), oldest first
        self._received: dict[str, Any] | None = None
        self._ahead: deque[dict[str, Any]] = deque()
        self._tracker = _ReceivedBatches(self)

    # -- Lightning's hooks -------------------------------------------------------------------

    def train_dataloader(self) -> TrainLoader:
        """The loader for this rank (built at the first call), as Lightning iterates it."""
        trainer = self.trainer
        if trainer is None:
            if self.loader is None:
                self.loader = Loader(self.source, **self.loader_kwargs)
            return TrainLoader(self)
        module = trainer.lightning_module
        if module is not None and is_param_in_hook_signature(module.training_step, "dataloader_iter",
                                                             explicit=True):
            raise ConfigError("ZerobatchDataModule: training_step(dataloader_iter) fetches its own batches, "
                              "so which batch the model received is not known; take the batch argument "
                              "instead", field="training_step")
        self._place(trainer.global_rank, trainer.world_size)
        callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if self._tracker not in callbacks:
            callbacks.append(self._tracker)
        return TrainLoader(self)

    def state_dict(self) -> dict[str, Any]:
        """``{"loader": state, "run_card": card}``: the loader's position after the last batch
        the model received, and its run card (``zerobatch trace`` reads it from the
        checkpoint file); ``{}`` before a loader exists."""
        if self._received is None and self.loader is None:
            return {}
        state = self._received if self._received is not None else self.loader.state_dict()
        out: dict[str, Any] = {STATE_KEY: state}
        if self.loader is not None:         # zerobatch trace CHECKPOINT.ckpt --step N
            from zerobatch.adapters.provenance import card_or_none
            out["run_card"] = card_or_none(self.loader, state)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue at the position of :meth:`state_dict` (at the next pass).

        Raises:
            StateError: not a state of this datamodule; or (once the loader exists) one that
                does not fit it (another dataset, order or seed...).
        """
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get(STATE_KEY), dict):
            got = f"a dict with keys {sorted(state_dict)}" if isinstance(state_dict, dict) else \
                type(state_dict).__name__
            raise StateError(f"ZerobatchDataModule: a state is {{'{STATE_KEY}': <loader state>}}, got {got}",
                             field=STATE_KEY)
        state = state_dict[STATE_KEY]
        if self.loader is not None:
            self.loader.load_state_dict(state)
        self._received, self._ahead = state, deque()

    # -- the loader, its passes and the count of received batches -----------------------------

    def _place(self, rank: int, world: int) -> None:
        """Make :attr:`loader` the loader of ``rank`` of ``world``, at this position."""
        loader = self.loader
        if loader is not None and (loader.rank, loader.world_size) == (rank, world):
            return
        if loader is not None and self.source is loader:
            raise ConfigError(f"ZerobatchDataModule: the Loader was built for rank {loader.rank} of "
                              f"{loader.world_size} but the trainer runs rank {rank} of {world}; pass the "
                              f"source and the loader's arguments instead", field="rank")
        position = self.state_dict().get(STATE_KEY)
        self.loader = Loader(self.source, rank=rank, world_size=world, **self.loader_kwargs)
        if position is not None:
            self.loader.load_state_dict(position)
        self._received, self._ahead = position, deque()

    def _pass(self) -> Iterator[Any]:
        """One pass for Lightning's fetcher (a generator: nothing runs before its first batch
        is asked for, which Lightning does after ``set_epoch``)."""
        loader = self.loader
        if loader is None:
            raise ConfigError("ZerobatchDataModule: iterate what train_dataloader() returns", field="loader")
        if self._ahead:
            # batches read for the loop that the model never received (the read-ahead of a
            # fit that ended, or of a pass Lightning dropped): the loop gets them next
            loader.load_state_dict(self._received)  # type: ignore[arg-type]
            self._ahead.clear()
        if self._epoch is not None and not loader.endless:
            loader.set_epoch(self._epoch)
        self._received = loader.state_dict()
        for batch in loader:
            self._ahead.append(loader.state_dict())
            yield batch

    def _received_one(self) -> None:
        if not self._ahead:
            raise StateError("ZerobatchDataModule: the training loop received a batch its loader did not "
                             "hand out", field=STATE_KEY)
        self._received = self._ahead.popleft()

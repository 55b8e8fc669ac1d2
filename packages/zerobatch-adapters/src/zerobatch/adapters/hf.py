"""Hugging Face: ``transformers.Trainer`` (and every subclass of it: TRL's ``SFTTrainer``...)
trains on a zerobatch :class:`~zerobatch.adapters.torch.Loader` and resumes exactly from its
own checkpoint, and ``accelerate`` checkpoints the loader in a loop of your own.

Trainer::

    from zerobatch.adapters.hf import attach
    from zerobatch.adapters.torch import Loader, TokenWindows

    loader = Loader(TokenWindows("data/tokens", seq_len=2048), global_batch_size=64, seed=1234)
    trainer = attach(Trainer(model=model, args=args), loader)
    trainer.train(resume_from_checkpoint=True)      # or None the first time

:func:`attach` makes the loader the trainer's train dataloader (batches in the form Hugging
Face models take: :func:`hf_batch`), and adds :class:`ZerobatchCallback`, which keeps the
loader's state in the trainer's own checkpoint (``trainer_state.json``, among the
``stateful_callbacks``). On ``resume_from_checkpoint`` the loader continues from that state
in O(1): the trainer's replay of the stream (``skip_first_batches``, slow and wrong across
epochs: accelerate#2016, #2859, transformers#26289) is switched off (``ignore_data_skip``),
and the first batch is read while the trainer loads the model and the optimizer
(:meth:`~zerobatch.adapters._loader.BaseLoader.start_prefetch`).

Why these hooks (tested with transformers 5.24.0, accelerate 1.15.0, TRL 1.16.0):
``get_train_dataloader`` is the Trainer's documented override point ("Subclass and override
this method if you want to inject some custom behavior"); ``TrainerCallback`` with
``ExportableState`` is how the Trainer's own callbacks (``EarlyStoppingCallback``) save
their state in its checkpoint; ``ignore_data_skip`` is a ``TrainingArguments`` field. A
``TrainerCallback`` receives the train dataloader in its events, so the callback holds no
reference of its own and survives ``restore_callback_states_from_checkpoint`` (which
rebuilds callbacks from their saved state). accelerate: ``Accelerator.register_for_checkpointing``
saves any object with ``state_dict``/``load_state_dict`` in ``save_state`` and restores it in
``load_state``; the loader is one (see ``docs/trainers/hf.md``).

The resume rule is the loader's: the same global batch continues exactly as an
uninterrupted run, on any number of processes; another global batch (other processes, batch
size or gradient accumulation) continues from the same position without skipping or
repeating a sample. Epochs are the loader's: the trainer sees one endless stream (its
``max_steps``; :func:`attach` derives it from ``num_train_epochs`` and the loader's length
when it is unset), and a gradient-accumulation group may span the end of an epoch, as in
zerobatch's own loop.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

try:
    import torch
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError("zerobatch.adapters.hf needs transformers: pip install 'zerobatch-adapters[hf]'") from exc

from zerobatch.formats.errors import ConfigError, StateError

__all__ = ["TrainerData", "ZerobatchCallback", "attach", "hf_batch"]

#: the key of the loader's state among a checkpoint's ``stateful_callbacks``
CALLBACK_NAME = "ZerobatchCallback"
IGNORE_INDEX = -100


def _unshifted(labels: torch.Tensor) -> torch.Tensor:
    """Next-token labels (``y[i]`` the target of input ``i``) in Hugging Face's unshifted
    convention (``labels[i + 1]`` the target of input ``i``): shifted right by one, ``-100``
    first (the last target is then only in ``shift_labels``)."""
    out = torch.full(labels.shape, IGNORE_INDEX, dtype=torch.long, device=labels.device)
    out[..., 1:] = labels[..., :-1]
    return out


def _targets(labels: torch.Tensor) -> torch.Tensor:
    """Labels as the loss takes them: ``int64`` (an ``int32`` loader's are widened; Hugging
    Face's cross entropy refuses ``int32`` targets) and whole (the loss flattens them with
    ``view()``)."""
    return labels.long().contiguous()


def hf_batch(step: Any, *, seq_idx: bool = False, flatten: bool = False) -> dict[str, Any]:
    """One loader step as the keyword arguments of a Hugging Face causal LM.

    - an ``(x, y)`` pair of next-token windows: ``input_ids = x``, ``labels`` (unshifted:
      the model shifts them) and ``shift_labels = y``, which Hugging Face's causal-LM loss and
      the Trainer's token count take as the targets as they are: every one of the window's
      ``seq_len`` targets is trained, the last included;
    - a dict with next-token ``labels`` (windows with metadata or a loss mask): the same
      ``labels`` / ``shift_labels``;
    - windows with boundaries: Hugging Face's flattening keyword arguments, exactly as
      ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` gives them for the pieces
      of documents in each row: ``labels`` unshifted with ``-100`` at each piece's first
      token (no document learns to predict the next one's start; and, with a loss mask,
      where it is off), ``position_ids``, ``cu_seq_lens_q/k`` and ``max_length_q/k``; with
      ``seq_idx`` also the per-token document index ``seq_idx`` (``int32``, the piece's
      number in its row: what linear-attention and state-space layers reset their state on,
      torchtitan#3984);
    - a step already in Hugging Face's layout (``layout="hf"`` sources) as it is.

    ``flatten``: one row of ``batch x seq_len`` tokens (``[1, total]``, as
    ``DataCollatorWithFlattening``), which attention implementations that find the documents
    from ``position_ids`` need (sdpa and eager take them only from a single row). Steps without
    document boundaries (plain windows, padded documents) get ``position_ids`` that restart at
    each row, so that no row attends to another; a padded row's padding stays at its end,
    untrained, and its attention mask is dropped.

    Labels are ``int64`` whatever the loader's ``dtype`` (the loss takes no other).
    """
    if isinstance(step, (tuple, list)):
        x, y = step
        out: dict[str, Any] = {"input_ids": x, "labels": _unshifted(y), "shift_labels": _targets(y)}
    elif isinstance(step, dict):
        if "cu_seq_lens_q" in step or ("labels" not in step and "cu_seqlens" not in step):
            out = dict(step)
            if isinstance(out.get("labels"), torch.Tensor):
                out["labels"] = _targets(out["labels"])
        else:
            out = {"input_ids": step["input_ids"]}
            pos = step.get("position_ids")
            if pos is None:
                if "labels" in step:
                    out.update(labels=_unshifted(step["labels"]), shift_labels=_targets(step["labels"]))
            else:
                # as DataCollatorWithFlattening: -100 at each piece's first token, so no
                # document is trained to predict the next one's start (the model shifts)
                labels = _unshifted(step["labels"]) if "labels" in step else step["input_ids"].to(torch.long, copy=True)
                labels[pos == 0] = IGNORE_INDEX
                out.update(labels=labels, position_ids=pos)
            if "cu_seqlens" in step:
                cu = step["cu_seqlens"]
                cu = cu.to(torch.int32) if isinstance(cu, torch.Tensor) else torch.as_tensor(cu, dtype=torch.int32)
                out.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=int(step["max_seqlen"]),
                           max_length_k=int(step["max_seqlen"]))
            if "attention_mask" in step:
                out["attention_mask"] = step["attention_mask"]
        out.pop("segment_ids", None)
    else:
        out = {"input_ids": step, "labels": _targets(step)}
    if flatten:
        ids = out["input_ids"]
        if "position_ids" not in out and ids.dim() == 2:
            # each row its own sequence: positions restart at every row, which is how attention
            # tells the rows apart once they are one (without them the rows would attend to one
            # another, and positions would run on across them)
            out["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape)
        for key, value in list(out.items()):
            if key in ("input_ids", "labels", "shift_labels", "position_ids") and value.dim() == 2:
                out[key] = value.reshape(1, -1)
        if out.get("attention_mask") is not None:
            del out["attention_mask"]      # flattened rows are told apart by position_ids
    if seq_idx:
        pos = out.get("position_ids")
        if pos is None:
            raise ConfigError("seq_idx needs the document boundaries: TokenWindows(boundaries=True) or "
                              "PackedDocuments", field="seq_idx")
        # each piece's number along the row (flattened: along the whole step, so that the
        # last piece of a row and the first of the next never share a number)
        out["seq_idx"] = ((pos == 0).cumsum(-1) - 1).to(torch.int32)
    return out


class TrainerData:
    """The loader as a Trainer's train dataloader: one endless stream of batches in Hugging
    Face's form (:func:`hf_batch`), epoch after epoch, with the loader's state.

    It has no length (the trainer counts ``max_steps``) and no ``set_epoch`` (the loader
    moves to the next epoch when one ends): the trainer's epoch bookkeeping, which restarts
    its count of a resumed epoch at zero, never decides what is read.
    """

    def __init__(self, loader: Any, *, seq_idx: bool = False, flatten: bool = False) -> None:
        if not (hasattr(loader, "state_dict") and hasattr(loader, "schedule")):
            raise ConfigError(f"attach: a zerobatch Loader, got {type(loader).__name__}", field="loader")
        self.loader = loader
        self.seq_idx, self.flatten = bool(seq_idx), bool(flatten)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        loader = self.loader
        while True:
            for step in loader:
                yield hf_batch(step, seq_idx=self.seq_idx, flatten=self.flatten)
            if loader.endless:
                return
            loader.set_epoch(loader.epoch + 1)

    @property
    def column_names(self) -> list[str]:
        """The keys of every batch, from the source's declared output (nothing is read):
        what libraries that inspect a dataset's columns (TRL's ``SFTTrainer``) ask for."""
        output = self.loader.source.output
        if not isinstance(output, dict):
            keys = ["input_ids", "labels"] + (["shift_labels"] if isinstance(output, (tuple, list)) else [])
        elif "cu_seq_lens_q" in output or ("labels" not in output and "cu_seqlens" not in output):
            keys = [k for k in output if k != "segment_ids"]
        else:
            if "position_ids" in output:
                keys = ["input_ids", "labels", "position_ids"]
            else:
                keys = ["input_ids"] + (["labels", "shift_labels"] if "labels" in output else [])
            if "cu_seqlens" in output:
                keys += ["cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"]
            if "attention_mask" in output and not self.flatten:
                keys.append("attention_mask")
        if self.flatten:
            keys = [k for k in keys if k != "attention_mask"]
            if "position_ids" not in keys:
                keys.append("position_ids")
        return keys + (["seq_idx"] if self.seq_idx else [])

    def as_dataset(self) -> Any:
        """This data as a Hugging Face ``datasets.IterableDataset`` of rows, for a trainer that
        insists on one (TRL's ``SFTTrainer(train_dataset=...)``, with
        ``dataset_kwargs={"skip_prepare_dataset": True}``, which looks at its first row): the
        rows of the source in its own order, read by a loader of their own, so looking at
        them never moves the training position. :func:`attach` makes the trainer read its
        batches from the loader, not from here."""
        import datasets

        from zerobatch.adapters.torch import Loader

        source, seq_idx, flatten = self.loader.source, self.seq_idx, self.flatten

        def rows() -> Iterator[dict[str, Any]]:
            # (not closed: closing a loader closes its source, which the training loader shares)
            ld = Loader(source, batch_size=source.rows_per_item, shuffle=False, rank=0, world_size=1, num_threads=0)
            for step in ld:
                batch = hf_batch(step, seq_idx=seq_idx, flatten=flatten)
                for r in range(len(batch["input_ids"])):
                    yield {k: v[r].tolist() for k, v in batch.items() if isinstance(v, torch.Tensor)
                           and v.dim() >= 1 and len(v) == len(batch["input_ids"])}

        return datasets.IterableDataset.from_generator(rows)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


class ZerobatchCallback(TrainerCallback, ExportableState):
    """Keeps the loader's state in the Trainer's checkpoint and restores it on resume.

    The state after every optimizer step (``on_step_end``, before the trainer saves) goes
    into ``trainer_state.json`` as this callback's state, with the step it belongs to and the
    loader's run card (``zerobatch trace checkpoint-N/trainer_state.json --step S``); on
    ``train(resume_from_checkpoint=...)`` the loader continues from it (:func:`attach` loads
    it before the trainer restores the model, so the first batch is read meanwhile; this
    callback checks at ``on_train_begin`` that the loader stands where the checkpoint said).
    """

    def __init__(self) -> None:
        self.loader_state: dict[str, Any] | None = None
        self.global_step = 0
        self._data: TrainerData | None = None

    def state(self) -> dict[str, Any]:
        # with the loader's run card (zerobatch trace CHECKPOINT/trainer_state.json --step N)
        attributes = {"loader_state": self.loader_state, "global_step": self.global_step}
        data = self.__dict__.get("_data")
        if data is not None and self.loader_state is not None:
            from zerobatch.adapters.provenance import card_or_none
            attributes["run_card"] = card_or_none(data.loader, self.loader_state)
        return {"args": {}, "attributes": attributes}

    def on_step_end(self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kwargs: Any) -> None:
        if isinstance(train_dataloader, TrainerData):
            self.loader_state = train_dataloader.state_dict()
            self.global_step = state.global_step
            self._data = train_dataloader

    def on_train_begin(self, args: Any, state: Any, control: Any, train_dataloader: Any = None,
                       **kwargs: Any) -> None:
        if not isinstance(train_dataloader, TrainerData) or state.global_step == 0:
            return
        saved = _saved(state.stateful_callbacks.get(CALLBACK_NAME), "the resumed checkpoint")
        if saved is None:
            raise StateError(f"the checkpoint of step {state.global_step} has no zerobatch loader state "
                             f"(stateful_callbacks[{CALLBACK_NAME!r}]): it was not saved by a Trainer with "
                             f"zerobatch.adapters.hf.attach, and the stream cannot be resumed exactly",
                             field="stateful_callbacks")
        if saved["global_step"] != state.global_step:
            raise StateError(f"the checkpoint's loader state is of step {saved['global_step']} but the trainer "
                             f"resumes at step {state.global_step}", field="global_step")
        if train_dataloader.loader.state_dict() != saved["loader_state"]:
            # attach() loaded it already unless train() was given no checkpoint path it could read
            train_dataloader.load_state_dict(saved["loader_state"])
        self.loader_state, self.global_step = saved["loader_state"], saved["global_step"]


def _saved(entry: Any, where: str) -> dict[str, Any] | None:
    """The callback's saved attributes from a ``stateful_callbacks`` entry (``None``: none)."""
    if entry is None:
        return None
    if isinstance(entry, list):
        entry = entry[-1] if entry else None
    attrs = entry.get("attributes") if isinstance(entry, dict) else None
    if not isinstance(attrs, dict) or not isinstance(attrs.get("loader_state"), dict) \
            or type(attrs.get("global_step")) is not int:
        if isinstance(attrs, dict) and attrs.get("loader_state") is None:
            return None                # saved before the first optimizer step
        raise StateError(f"{where}: a malformed zerobatch loader state in stateful_callbacks[{CALLBACK_NAME!r}]",
                         field="stateful_callbacks")
    return attrs


def _checkpoint(trainer: Any, resume: Any) -> str | None:
    """The checkpoint folder ``train(resume_from_checkpoint=resume)`` resumes from."""
    if resume is None or resume is False:
        return None
    if resume is True:
        from transformers.trainer_utils import get_last_checkpoint
        return get_last_checkpoint(trainer.args.output_dir)
    return os.fspath(resume)


def attach(trainer: Any, loader: Any, *, seq_idx: bool = False, flatten: bool = False) -> Any:
    """Train ``trainer`` (a ``transformers.Trainer`` or subclass) on ``loader`` and keep the
    loader's position in the trainer's checkpoints; returns ``trainer``.

    Args:
        trainer: the trainer, made without a ``train_dataset`` or with one it will not read.
        loader: a :class:`zerobatch.adapters.torch.Loader` (or the :class:`TrainerData` over
            one given to the trainer as its ``train_dataset``, as TRL's ``SFTTrainer`` wants
            one); its batch is the per-device micro-batch (``global_batch_size`` over the
            processes and the accumulation steps); ``per_device_train_batch_size`` is not used.
        seq_idx, flatten: as :func:`hf_batch`.

    Raises:
        ConfigError: not a Trainer or not a loader; ``max_steps`` unset and the loader
            endless (a mixture: there are no epochs to count).
    """
    if not isinstance(trainer, Trainer):
        raise ConfigError(f"attach: a transformers.Trainer, got {type(trainer).__name__}", field="trainer")
    if isinstance(loader, TrainerData):
        data, loader = loader, loader.loader
    else:
        data = TrainerData(loader, seq_idx=seq_idx, flatten=flatten)
    args = trainer.args
    if args.max_steps is None or args.max_steps <= 0:
        if loader.endless:
            raise ConfigError("max_steps: the loader is endless (a mixture), so the trainer cannot count epochs; "
                              "set TrainingArguments(max_steps=...)", field="max_steps")
        args.max_steps = max(1, math.ceil(args.num_train_epochs * len(loader) / args.gradient_accumulation_steps))
    # the loader resumes itself: the trainer must not replay the stream
    args.ignore_data_skip = True
    trainer.get_train_dataloader = lambda: data
    trainer.zerobatch_data = data
    if not any(isinstance(cb, ZerobatchCallback) for cb in trainer.callback_handler.callbacks):
        trainer.add_callback(ZerobatchCallback())
    train = trainer.train

    def train_resumable(resume_from_checkpoint: Any = None, *a: Any, **kw: Any) -> Any:
        folder = _checkpoint(trainer, resume_from_checkpoint)
        if folder is not None:
            path = os.path.join(folder, "trainer_state.json")
            try:
                with open(path) as f:
                    stored = json.load(f).get("stateful_callbacks", {}).get(CALLBACK_NAME)
            except FileNotFoundError:
                stored = None
            except (OSError, ValueError, AttributeError) as exc:
                raise StateError(f"{path}: not a readable trainer state ({exc})", field="trainer_state") from None
            saved = _saved(stored, path)
            if saved is not None:
                # the position now, and the first batch read while the trainer loads the
                # model, the optimizer and the RNG states
                data.load_state_dict(saved["loader_state"])
                loader.start_prefetch()
        return train(resume_from_checkpoint, *a, **kw)

    trainer.train = train_resumable
    return trainer

"""torchtitan (0.3.0) fed by zerobatch through ``ZerobatchDataLoader``, two loops:

``--loop trainer``: torchtitan's own Trainer on CPU, one process. The run is torchtitan's:
``Trainer.Config`` (the llama3 debug model, cut to one layer and the test data's vocabulary),
``config.build()``, ``trainer.train()`` with its own train step, gradient accumulation, DCP
``CheckpointManager`` save every ``--save-at`` steps and load of the latest checkpoint at
start. It needs ``triton`` importable (torchtitan's model code imports it, CPU or not).

``--loop manager``: torchtitan's data and checkpoint components in a plain loop, on 1 or 2
processes (gloo): the dataloader built from its config as the Trainer builds it
(``config.build(dp_world_size=, dp_rank=, ...)``), ``trainerkit.RecordingLM`` (gradients
all-reduced), and torchtitan's ``CheckpointManager`` (with its optimizer and LR-scheduler
containers and a train state) saving and loading the DCP checkpoints. It runs where the
Trainer cannot: 2 ranks on CPU (the Trainer shards with FSDP, whose gradient reduction uses a
reduction gloo does not have).

What the test adds to the Trainer:

- a forward pre-hook on the model that logs the input ids of every forward call to
  ``$ZB_RECORD.rank<r>`` (one JSON line per call, as ``trainerkit.RecordingLM`` does);
- ``--kill``: SIGKILL right after the checkpoint of step ``--save-at`` was written;
- the device: torchtitan 0.3.0 picks it at import as ``_get_available_device_type() or
  "cuda"`` and has no CPU setting, so on a machine without an accelerator it would ask CUDA
  for everything. :func:`use_cpu` points its device globals at the CPU (``torch.cpu``, with
  the memory-monitor calls an accelerator module has answered as no-ops) before the trainer
  is built; the process group is then gloo (torch's default backend for ``cpu``).

``--nproc 2`` starts two ranks of this script (``RANK``, ``WORLD_SIZE``... set as torchrun
does) and waits; if a rank was SIGKILLed it SIGKILLs itself too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import types
from typing import Any

import torch


def use_cpu() -> None:
    """torchtitan's device globals -> the CPU (see the module documentation); and
    ``torch.distributed.set_timeout``, which torchtitan 0.3.0 calls after the first step, for
    a torch that has it under its earlier private name only (torch 2.13: ``_set_pg_timeout``,
    made public as ``set_timeout`` by pytorch#187387)."""
    import torch.distributed as dist
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout
    cpu = types.SimpleNamespace(
        set_device=lambda device: None, current_device=lambda: 0, device_count=lambda: 1,
        synchronize=lambda *a: None, is_available=lambda: True, get_device_name=lambda *a: "cpu",
        get_device_properties=lambda *a: types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE")
                                                                * os.sysconf("SC_PHYS_PAGES")),
        memory_stats=lambda *a: {}, reset_peak_memory_stats=lambda *a: None, empty_cache=lambda: None)
    import importlib
    for name in ("torchtitan.tools.utils", "torchtitan.distributed.utils", "torchtitan.components.metrics",
                 "torchtitan.distributed.parallel_dims", "torchtitan.tools.profiler",
                 "torchtitan.models.common.token_dispatcher"):
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = cpu


def record_inputs(model: torch.nn.Module) -> None:
    path = os.environ.get("ZB_RECORD")
    if path is None:
        return
    log = open(f"{path}.rank{os.environ.get('RANK', '0')}", "a")

    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if module.training:
            log.write(json.dumps(args[0].tolist()) + "\n")
            log.flush()

    model.register_forward_pre_hook(hook, with_kwargs=True)


def build_config(args: argparse.Namespace) -> Any:
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from zerobatch.adapters.torchtitan import ZerobatchDataLoader

    config = llama3_debugmodel()
    model = config.model_spec.model
    vocab = args.vocab
    model.vocab_size = vocab
    model.tok_embeddings.num_embeddings = vocab
    model.lm_head.out_features = vocab
    model.layers = model.layers[:1]
    # FlexAttention (the debug model's) has no backward on CPU and varlen attention is CUDA's:
    # the one layer attends with SDPA (causal; torchtitan builds no document mask for it, and
    # still hands it the positions, for RoPE), as torchtitan's graph_trainer tests configure
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.loss = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab))
    config.hf_assets_path = args.tokenizer
    config.dump_folder = args.ckpt
    config.training.seq_len = args.seq_len
    config.training.local_batch_size = args.local_batch
    config.training.global_batch_size = args.global_batch
    config.training.steps = args.steps
    config.training.disable_cuda_graphs = True
    config.lr_scheduler.warmup_steps = 1
    config.metrics = MetricsProcessor.Config(log_freq=1000)
    config.validator.enable = False
    config.checkpoint.enable = True
    config.checkpoint.interval = args.save_at or args.steps + 1
    config.checkpoint.last_save_model_only = False
    config.checkpoint.keep_latest_k = 0
    config.dataloader = ZerobatchDataLoader.Config(dataset_path=args.data, seed=args.seed, num_threads=1)
    return config


def train(args: argparse.Namespace) -> None:
    """``--loop trainer``: torchtitan's Trainer."""
    use_cpu()
    from trainerkit import die

    config = build_config(args)
    trainer = config.build()
    record_inputs(trainer.model_parts[0])
    save = trainer.checkpointer.save

    def save_then_die(curr_step: int, last_step: bool = False) -> bool:
        saved = save(curr_step, last_step=last_step)
        if args.kill and saved and curr_step == args.save_at:
            die()
        return saved

    trainer.checkpointer.save = save_then_die
    try:
        trainer.train()
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def manager_loop(args: argparse.Namespace) -> None:
    """``--loop manager``: torchtitan's dataloader config and CheckpointManager in a plain loop."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.stateful import Stateful
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from trainerkit import RecordingLM, die

    from zerobatch.adapters.torchtitan import ZerobatchDataLoader

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world > 1:
        dist.init_process_group("gloo")
    dp_degree = world
    accum = args.global_batch // (args.local_batch * dp_degree)
    torch.manual_seed(0)
    model = RecordingLM(shift=False)
    dataloader = ZerobatchDataLoader.Config(dataset_path=args.data, seed=args.seed, num_threads=1).build(
        dp_world_size=dp_degree, dp_rank=rank, tokenizer=None, seq_len=args.seq_len,
        local_batch_size=args.local_batch, snapshot_every_n_steps=args.save_at)
    optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers,
                                                                    training_steps=args.steps)

    class TrainState(Stateful):
        step = 0

        def state_dict(self) -> dict[str, Any]:
            return {"step": self.step}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.step = state["step"]

    train_state = TrainState()
    checkpointer = CheckpointManager.Config(enable=True, interval=args.save_at or args.steps + 1,
                                            last_save_model_only=False, keep_latest_k=0).build(
        dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": train_state}, sd_adapter=None, base_folder=args.ckpt)
    checkpointer.load()
    batches = iter(dataloader)
    while train_state.step < args.steps:
        train_state.step += 1
        optimizers.zero_grad()
        for _ in range(accum):
            inputs, labels = next(batches)
            out = model(input_ids=inputs["input"], labels=labels)
            (out["loss"] / accum).backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        optimizers.step()
        schedulers.step()
        saved = checkpointer.save(train_state.step, last_step=train_state.step == args.steps)
        if args.kill and saved and train_state.step == args.save_at:
            die()
    checkpointer.close()
    dataloader.close()
    if world > 1:
        dist.destroy_process_group()


def launch(args: argparse.Namespace, argv: list[str]) -> None:
    """Start ``args.nproc`` ranks of this script (as torchrun would) and wait for them."""
    from trainerkit import die
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(args.nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.nproc),
               "LOCAL_WORLD_SIZE": str(args.nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, __file__, *argv, "--nproc", "0"], env=env))
    codes = [p.wait() for p in procs]
    if -signal.SIGKILL in codes:
        die()
    sys.exit(max(abs(c) for c in codes))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("ckpt")
    p.add_argument("--tokenizer", help="a folder with a tokenizer.json (the Trainer loads one)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--kill", action="store_true")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--local-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1 << 13)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--nproc", type=int, default=1, help="ranks to start (0: this process is one)")
    p.add_argument("--loop", choices=("trainer", "manager"), default="trainer")
    args = p.parse_args()
    if args.nproc > 1:
        launch(args, sys.argv[1:])
        return
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    train(args) if args.loop == "trainer" else manager_loop(args)


if __name__ == "__main__":
    main()

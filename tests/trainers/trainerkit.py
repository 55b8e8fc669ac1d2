"""What the trainer tests share: a model that records what it received, the kill-and-resume
runs, and the comparison of what the model saw.

Each test runs the trainer's real loop in fresh interpreters: uninterrupted for ``2N`` steps,
then for ``N`` steps killed with SIGKILL right after the trainer's own checkpoint of step
``N`` was written, then resumed from that checkpoint for ``N`` more. :class:`RecordingLM`
appends the ``input_ids`` of every forward call to a log per rank; the comparison reads those
logs, not the loader's counters.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
#: vocabulary of the tiny model (the test datasets' token ids stay below it)
VOCAB = 1 << 14


class RecordingLM(torch.nn.Module):
    """A tiny causal LM (embedding, linear head) that logs the ``input_ids`` of every forward
    call in training mode: one JSON line per call in ``$ZB_RECORD.rank<r>`` (r from ``RANK``)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 8, shift: bool = True) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)
        self.shift = shift      # HF convention: labels unshifted, the model shifts them
        path = os.environ.get("ZB_RECORD")
        self._log = None if path is None else open(f"{path}.rank{os.environ.get('RANK', '0')}", "a")

    def record(self, input_ids: torch.Tensor) -> None:
        if self._log is not None and self.training:
            self._log.write(json.dumps(input_ids.tolist()) + "\n")
            self._log.flush()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        self.record(input_ids)
        logits = self.head(self.embed(input_ids))
        if labels is None:
            return {"logits": logits}
        if self.shift:
            logits, labels = logits[..., :-1, :], labels[..., 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 labels.reshape(-1), ignore_index=-100)
        return {"loss": loss, "logits": logits}


def record_inputs(model: torch.nn.Module) -> torch.nn.Module:
    """Log the ``input_ids`` of every training forward call of ``model`` (any module, a real
    Hugging Face model included) with a forward pre-hook, as :class:`RecordingLM` does."""
    path = os.environ.get("ZB_RECORD")
    if path is None:
        return model
    log = open(f"{path}.rank{os.environ.get('RANK', '0')}", "a")

    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if module.training and ids is not None:
            log.write(json.dumps(ids.tolist()) + "\n")
            log.flush()

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def merge_ranks(calls: list[list[Any]]) -> list[Any]:
    """One process's view of a multi-process run: the forward calls of every rank (``calls[r]``,
    ``input_ids`` rows per call) merged call by call into the global batch, rank ``r``'s row
    ``i`` at global row ``i * world_size + r`` (zerobatch deals the rows of a global batch out
    to the ranks in turn)."""
    world = len(calls)
    assert len({len(c) for c in calls}) == 1, [len(c) for c in calls]
    merged = []
    for step in zip(*calls):
        rows = [None] * sum(len(s) for s in step)
        for r, s in enumerate(step):
            rows[r::world] = s
        merged.append(rows)
    return merged


def die() -> None:
    """SIGKILL this process (no clean exit: no atexit, no flushing of anything not yet written)."""
    os.kill(os.getpid(), signal.SIGKILL)


def run(argv: list[str], *, record: Path, timeout: float = 300, env: dict[str, str] | None = None,
        expect_killed: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (a script and its arguments, or ``-m ...``) with this interpreter, recording
    forward calls under ``record``; checks the return code (killed by SIGKILL when
    ``expect_killed``: -9, or a launcher's failure naming it)."""
    full = {**os.environ, "ZB_RECORD": str(record), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1",
            **(env or {})}
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=full)
    want = -signal.SIGKILL if expect_killed else 0
    # (a launcher whose workers were killed exits 1 and says which signal ended them)
    killed = r.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL) or \
        (r.returncode != 0 and "Signal 9 (SIGKILL) received" in r.stderr)
    if (expect_killed and not killed) or (not expect_killed and r.returncode != 0):
        raise AssertionError(f"{argv[:2]} returned {r.returncode}, expected {want}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return r


def recorded(record: Path, rank: int = 0) -> list[list[list[int]]]:
    """The ``input_ids`` of every forward call of ``rank``, in order."""
    path = Path(f"{record}.rank{rank}")
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def assert_resumed_exactly(full: list[Any], before: list[Any], after: list[Any], n: int) -> None:
    """The first ``n`` forward calls of the killed run and every call of the resumed run are,
    call for call and token for token, the uninterrupted run's."""
    assert len(full) >= n + len(after) and len(before) >= n, (len(full), len(before), len(after), n)
    assert before[:n] == full[:n], "the killed run diverged before its checkpoint"
    assert after, "the resumed run trained on nothing"
    for k, (got, want) in enumerate(zip(after, full[n:n + len(after)])):
        assert got == want, f"resumed call {k} (call {n + k} of the run) differs from the uninterrupted run"
    assert len(after) == len(full) - n, (len(after), len(full) - n)


def chat_stream(folder: str | os.PathLike[str], n_docs: int = 120, seed: int = 3) -> str:
    """A TOKSTREAM dataset of conversations with a loss mask beside it (runs of trained and
    untrained tokens, as ``convert --chat`` writes for assistant and user turns); token ids
    below :data:`VOCAB`. Returns the folder."""
    import numpy as np
    from zerobatch.writers.tokstream import TokenStreamWriter
    rng = np.random.default_rng(seed)
    folder = Path(folder)
    w = TokenStreamWriter(folder, vocab_size=VOCAB, shard_tokens=700)
    m = TokenStreamWriter(folder / "loss_mask", vocab_size=2, shard_tokens=700)
    for _ in range(n_docs):
        turns = rng.integers(1, 12, int(rng.integers(2, 7)))
        mask = np.concatenate([np.full(n, j % 2, np.uint16) for j, n in enumerate(turns.tolist())])
        w.add_document(rng.integers(1, VOCAB, mask.size))
        m.add_document(mask)
    w.close(loss_mask=m.close())
    return str(folder)


def rows(calls: list[list[Any]]) -> list[Any]:
    """The rows of every forward call, in order: for trainers that cut a step into micro-batches
    of a fixed number of rows per process, so that the calls of runs on different numbers of
    processes differ while the rows of each step do not (compare ``rows`` of a 1-process run
    with ``merge_ranks([[rows(rank0)], [rows(rank1)]])[0]`` of a 2-process one)."""
    return [row for call in calls for row in call]

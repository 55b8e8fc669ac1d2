"""Helpers shared by the zerobatch tests (tests/ is on sys.path through pytest's pythonpath)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def seed_layout_bytes(tokens: np.ndarray, batch_size: int, seq_len: int, *, seed: int = 0,
                      total_records: int | None = None) -> bytes:
    """An LLMBATCH file exactly as the seed's spec writes it: header, zeros, padded batches,
    no zerobatch extension. ``tokens`` are the records, already in file order."""
    n = tokens.shape[0] // batch_size
    raw = batch_size * seq_len * 4
    padded = -(-raw // 4096) * 4096
    header = struct.pack("<8sIIIQIII", b"LLMBATCH", 1, batch_size, seq_len, n, 0, seed,
                         tokens.shape[0] if total_records is None else total_records)
    out = bytearray(header.ljust(4096, b"\0"))
    for b in range(n):
        block = tokens[b * batch_size:(b + 1) * batch_size].astype("<u4").tobytes()
        out += block.ljust(padded, b"\0")
    return bytes(out)


class SeedSpecReader:
    """A reader written from the seed's spec alone (offsets from the header, nothing else)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        (_, self.version, self.batch_size, self.seq_len, self.num_batches, self.dtype, self.seed,
         self.total_records) = struct.unpack_from("<8sIIIQIII", data, 0)
        raw = self.batch_size * self.seq_len * 4
        self.padded = -(-raw // 4096) * 4096

    def read_batch(self, i: int) -> np.ndarray:
        offset = 4096 + i * self.padded
        end = offset + self.batch_size * self.seq_len * 4
        return np.frombuffer(self.data[offset:end], dtype=np.uint32).reshape(self.batch_size, self.seq_len)


def records(n: int, seq_len: int, *, seed: int = 0, vocab: int = 50257) -> np.ndarray:
    """Distinct-looking random records: each row starts with its own index."""
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, vocab, size=(n, seq_len), dtype=np.uint32)
    arr[:, 0] = np.arange(n, dtype=np.uint32)
    return arr


def run_python(code: str, *, env: dict[str, str] | None = None, timeout: float = 120,
               cwd: str | None = None, script_dir: str | os.PathLike[str] | None = None
               ) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (same environment), capturing output.

    With ``script_dir`` the code is written to a file there and run as a script, which
    ``spawn`` and ``forkserver`` children need (they import ``__main__`` by path).
    """
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    code = textwrap.dedent(code)
    if script_dir is not None:
        script = Path(script_dir) / "zb_script.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    else:
        argv = [sys.executable, "-c", code]
    return subprocess.run(argv, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd)


_FORK_SERVER = r"""
import json, os, sys, traceback
exec(sys.argv[1])
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for fd, name in ((1, req["out"]), (2, req["err"])):
                os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
            os.environ.update(req["env"])
            from zerobatch.core import io as _io
            _io._FAULTS.__init__()          # the fault plan reads the environment it is given
            exec(compile(req["code"], "<forked>", "exec"), {"__name__": "__main__"})
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


class ForkServer:
    """Runs code as :func:`run_python` does, each run in a child forked from one interpreter
    that imported ``imports`` once (single-threaded, so forking it is safe): a kill -9 harness
    with hundreds of kill points pays the interpreter start and the imports once, not at every
    point (0.5 s each here). Children read their environment (the fault plan included) at
    the fork; a killed child's return code is ``-9`` as with :func:`run_python`.

    Use as a context manager; :meth:`run` returns a ``CompletedProcess``.
    """

    def __init__(self, imports: str, tmp: str | os.PathLike[str]) -> None:
        self.tmp = Path(tmp)
        self.proc = subprocess.Popen([sys.executable, "-c", _FORK_SERVER, textwrap.dedent(imports)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, code: str, *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        out, err = self.tmp / "fork.out", self.tmp / "fork.err"
        req = {"code": textwrap.dedent(code), "env": env or {}, "out": str(out), "err": str(err)}
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server died (return code {self.proc.wait()})")
        return subprocess.CompletedProcess(["<forked>"], int(line), out.read_text(), err.read_text())

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def token_stream(folder, n_tokens=4000, seed=0, metadata=False, offset=0):
    """A TOKSTREAM dataset whose token at global position p is ``p + offset`` (a window's
    first token names it), in documents of random lengths; returns ``(folder, documents)``."""
    from zerobatch.writers.tokstream import TokenStreamWriter
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, n_tokens), size=n_tokens // 60, replace=False))
    docs = np.split(np.arange(n_tokens) + offset, cuts)
    with TokenStreamWriter(folder, vocab_size=1 << 20, metadata=metadata, shard_tokens=900) as w:
        for k, d in enumerate(docs):
            w.add_document(d, {"doc": k} if metadata else None)
    return str(folder), docs


def take(batches, k, key):
    """``key(batch)`` of the first ``k`` batches of ``batches`` (all of them when ``k`` is None),
    stopping the iteration there, as a training loop interrupted at step ``k`` does."""
    out = []
    if k == 0:
        return out
    for batch in batches:
        out.append(key(batch))
        if k is not None and len(out) == k:
            break
    return out


# A ChatML template whose assistant turns are marked for transformers' assistant mask, and the
# special tokens it needs (tests/prepare/test_chat.py, tests/cli/test_chat_commands.py).
CHATML = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
          "{%- if message['role'] == 'assistant' %}{% generation %}{{ (message['content'] or '') + '<|im_end|>\\n' }}"
          "{% endgeneration %}{%- else %}{{ (message['content'] or '') + '<|im_end|>\\n' }}{%- endif %}"
          "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
CHATML_SPECIALS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<|im_start|>"}


def chat_tokenizer(folder, template, specials):
    """A tokenizer folder (``tokenizer.json`` trained here on the quickstart's text, nothing
    downloaded, and a ``tokenizer_config.json`` holding ``template``); returns its path."""
    from tokenizers import Tokenizer

    from zerobatch.cli.quickstart import bundled_text, train_tokenizer
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "t.txt").write_text(bundled_text()[:60_000])
    train_tokenizer(str(folder / "t.txt"), 400, str(folder / "tokenizer.json"))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(list(specials.values()))
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast", **specials}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def ddp_logged_steps(logs, last: int) -> tuple[list[int], dict[int, list[list[int]]]]:
    """``(starts, steps)`` of the runs of ``examples/ddp_train.py --ids-log logs``: the step
    each run started at, and per step the window ids each rank trained on, each run's log cut
    at the step the next run resumed from (what it trained after that was lost with it)."""
    import json
    from pathlib import Path
    files = sorted(Path(logs).glob("start*.jsonl"))
    starts = sorted({int(f.name[5:11]) for f in files})
    steps: dict[int, list[list[int]]] = {}
    for f in files:
        start = int(f.name[5:11])
        later = [s for s in starts if s > start]
        stop = later[0] if later else last
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if rec["step"] <= stop:
                steps.setdefault(rec["step"], []).append(rec["ids"])
    return starts, steps


def uninterrupted_order(data, seq_len: int, global_batch: int, seed: int, steps: int) -> list[list[int]]:
    """The sorted window ids of each of the first ``steps`` steps of an uninterrupted run of
    ``examples/ddp_train.py`` (one process, epochs in turn)."""
    from zerobatch.adapters.torch import Loader, TokenWindows
    ref = Loader(TokenWindows(data, seq_len), global_batch_size=global_batch, seed=seed, rank=0, world_size=1)
    expected: list[list[int]] = []
    epoch = 0
    while len(expected) < steps:
        ref.set_epoch(epoch)
        expected += [sorted((x[:, 0] // seq_len).tolist()) for x, _ in ref]
        epoch += 1
    return expected[:steps]


def launch_env(**extra: str) -> dict[str, str]:
    """This environment without a launcher's variables (torchrun's, Slurm's, zerobatch's
    launch id), plus ``extra``: processes a test starts as ranks of its own launch."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_", "ZEROBATCH_"))}
    env.update(extra)
    return env


def start_together(procs: list[subprocess.Popen], signals: list, *, settle: float = 2.0,
                   timeout: float = 120) -> None:
    """Let ``procs`` (started, each waiting for a file of ``signals``) get ready for
    ``settle`` seconds, create the files, and wait for every one to exit 0 (all killed
    whatever happens)."""
    time.sleep(settle)
    for s in signals:
        open(s, "w").close()
    try:
        for p in procs:
            assert p.wait(timeout) == 0
    finally:
        for p in procs:
            p.kill()

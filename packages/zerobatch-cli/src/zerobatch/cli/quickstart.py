"""``zerobatch quickstart``: the whole path from raw text to a training loop, on the CPU, with
nothing downloaded.

1. train a byte-level BPE tokenizer (Hugging Face ``tokenizers``) on the bundled text
   (Shakespeare, public domain: the "tiny shakespeare" corpus, 1.1 MB);
2. ``zerobatch convert`` it twice (one document per speech): to a TOKSTREAM dataset and to an
   LLMBATCH ``.batch`` file, then ``verify`` both;
3. train a tiny causal language model for ``--steps`` steps through
   :class:`zerobatch.adapters.torch.Loader` over next-token windows of the token stream,
   printing the loss as it falls and the tokens/s the loader delivered; then measure the loss
   on batches streamed from the ``.batch`` file, and sample a line of text.
"""

from __future__ import annotations

import gzip
import os
import sys
import tempfile
import time
from importlib import resources
from typing import Any, NamedTuple

__all__ = ["quickstart"]

BUNDLED = "tinyshakespeare.txt.gz"


class _Settings(NamedTuple):
    steps: int
    workdir: str | None
    vocab: int
    seq_len: int
    batch_size: int
    text: str | None
    seed: int


def bundled_text() -> str:
    """The public-domain text shipped with zerobatch-cli."""
    return gzip.decompress(resources.files("zerobatch.cli").joinpath("data", BUNDLED).read_bytes()).decode("utf-8")


def train_tokenizer(text_path: str, vocab: int, out: str) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([text_path], trainer)
    tok.save(out)
    return tok


def _model(vocab: int, seq_len: int, dim: int = 128, layers: int = 2, heads: int = 4) -> Any:
    import torch
    import torch.nn as nn

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, dim)
            self.pos = nn.Embedding(seq_len, dim)
            layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)
            self.head.weight = self.tok.weight     # tied embeddings
            nn.init.normal_(self.tok.weight, std=0.02)
            nn.init.normal_(self.pos.weight, std=0.02)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t = x.shape[1]
            h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
            mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
            return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))

    return TinyLM()


def quickstart(*, steps: int = 300, workdir: str | None = None, vocab: int = 2048, seq_len: int = 128,
               batch_size: int = 16, text: str | None = None, seed: int = 0) -> int:
    """``zerobatch quickstart``: train a tokenizer on ``text`` (default: the bundled
    public-domain Shakespeare), convert it to TOKSTREAM and LLMBATCH, verify both, train a
    tiny causal LM for ``steps`` steps of ``batch_size`` x ``seq_len`` tokens through the
    zerobatch loader and report the loss and the loader's share of the time. Returns the exit
    status. ``workdir`` keeps the files (default: a temporary folder)."""
    args = _Settings(steps, workdir, vocab, seq_len, batch_size, text, seed)
    import torch

    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    keep = args.workdir
    tmp = None if keep else tempfile.TemporaryDirectory(prefix="zerobatch-quickstart-")
    work = keep or tmp.name  # type: ignore[union-attr]
    os.makedirs(work, exist_ok=True)
    try:
        t_all = time.perf_counter()
        prepared = _prepare(args, work)
        if prepared is None:
            return 1
        tok, stream, batch_file = prepared
        model = _train(args, stream, tok.get_vocab_size())
        _evaluate(args, model, tok, batch_file)
        print(f"done in {time.perf_counter() - t_all:.1f} s" + (f"; files kept in {work}" if keep else ""))
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


def _prepare(args: _Settings, work: str) -> tuple[Any, str, str] | None:
    """Steps 1-3: the corpus, its tokenizer, the TOKSTREAM and LLMBATCH datasets, verified;
    ``(tokenizer, stream folder, batch file)``, or None after printing a fault."""
    from zerobatch.prepare.pipeline import convert
    from zerobatch.cli.datasets import open_dataset

    text_path = os.path.join(work, "corpus.txt")
    if args.text:
        with open(args.text, encoding="utf-8", errors="replace") as f:
            text = f.read()
    else:
        text = bundled_text()
    with open(text_path, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"[1/4] corpus: {text_path} ({len(text):,} characters"
          + (", Shakespeare: public domain)" if not args.text else ")"))

    t0 = time.perf_counter()
    tok_path = os.path.join(work, "tokenizer.json")
    tok = train_tokenizer(text_path, args.vocab, tok_path)
    print(f"[2/4] tokenizer: byte-level BPE, {tok.get_vocab_size()} ids, trained in {time.perf_counter() - t0:.1f} s "
          f"-> {tok_path}")

    stream, batch_file = os.path.join(work, "corpus.tokstream"), os.path.join(work, "corpus.batch")
    print("[3/4] zerobatch convert (one document per speech; <|endoftext|> after each)")
    common = {"tokenizer": tok_path, "split": "blank", "workers": 2, "quiet": True,
              "log": lambda s: print("  " + s)}
    convert(text_path, stream, to="tokstream", **common)
    convert(text_path, batch_file, to="llmbatch", seq_len=args.seq_len + 1, batch_size=args.batch_size, **common)
    for path in (stream, batch_file):
        ds = open_dataset(path)
        faults, summary = ds.verify(None)
        ds.close()
        if faults:
            print(f"  verify {path}: FAULT: {faults[0]}", file=sys.stderr)
            return None
        print(f"  verify {os.path.basename(path)}: OK ({summary})")
    return tok, stream, batch_file


def _train(args: _Settings, stream: str, vocab: int) -> Any:
    """Step 4: the tiny model trained through the loader over ``stream``, with the loss and
    the loader's share of the time printed; the model."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from zerobatch.adapters.torch import Loader, TokenWindows

    print(f"[4/4] training a tiny causal LM ({args.steps} steps of {args.batch_size} x {args.seq_len} tokens, "
          "CPU) through zerobatch.adapters.torch.Loader over TokenWindows")
    loader = Loader(TokenWindows(stream, args.seq_len), args.batch_size, shuffle=True, seed=args.seed)
    model = _model(vocab, args.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-3, total_steps=args.steps, pct_start=0.1)
    step = 0
    wait = 0.0
    delivered = 0
    first_loss = last = float("nan")
    t_train = time.perf_counter()
    every = max(1, args.steps // 12)
    epoch = 0
    while step < args.steps:
        loader.set_epoch(epoch)
        it = iter(loader)
        while step < args.steps:
            t = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                break
            wait += time.perf_counter() - t
            delivered += x.numel()
            loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            last = loss.item()
            if step == 1:
                first_loss = last
            if step == 1 or step % every == 0 or step == args.steps:
                print(f"  step {step:>4}  loss {last:.3f}  ({time.perf_counter() - t_train:.1f} s)")
        epoch += 1
    metrics = loader.metrics()
    loader.close()
    train_s = time.perf_counter() - t_train
    print(f"  loss {first_loss:.3f} -> {last:.3f} (uniform guess: {np.log(vocab):.3f})")
    print(f"  loader: {delivered:,} tokens in {wait * 1e3:.1f} ms waiting on next(): "
          f"{delivered / max(wait, 1e-9) / 1e6:,.0f}M tokens/s, {100 * wait / train_s:.2f} % of the training time; "
          f"training {delivered / train_s:,.0f} tokens/s")
    from zerobatch.adapters.metrics import format_metrics
    print(f"  loader.metrics(): {format_metrics(metrics)}")
    return model


def _evaluate(args: _Settings, model: Any, tok: Any, batch_file: str) -> None:
    """The model's loss on batches streamed from the LLMBATCH file, and a sample."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from zerobatch.adapters.torch import BatchNativeLoader

    vocab = tok.get_vocab_size()
    model.eval()
    ev = BatchNativeLoader(batch_file, seed=args.seed)
    losses = []
    with torch.no_grad():
        for k, batch in enumerate(ev):
            if k == 8:
                break
            logits = model(batch[:, :-1])
            losses.append(float(F.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))))
    ev.close()
    print(f"  loss on {len(losses)} batches streamed from {os.path.basename(batch_file)}: {np.mean(losses):.3f}")
    ids = tok.encode("ROMEO:\n").ids
    with torch.no_grad():
        for _ in range(60):
            ctx = torch.tensor([ids[-args.seq_len:]])
            probs = torch.softmax(model(ctx)[0, -1] / 0.8, -1)
            ids.append(int(torch.multinomial(probs, 1)))
    print("  sample: " + tok.decode(ids).replace("\n", "\n          "))

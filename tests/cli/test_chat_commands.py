"""What the zerobatch command shows and checks of a chat dataset (its tokens and loss mask):
``convert --chat``'s progress bar, ``head`` marking the trained tokens (with a tokenizer
folder), ``stats`` giving their fraction, ``verify`` and ``inspect`` checking the mask with the
tokens. How the mask is made is tests/prepare/test_chat.py."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from zerobatch.cli.formats.tokstream import show_trained  # noqa: E402
from zerobatch.prepare.chat import ChatTemplate  # noqa: E402
from zerobatch.writers.tokstream import TokenStreamWriter  # noqa: E402
from zbtest import CHATML, CHATML_SPECIALS, chat_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return chat_tokenizer(tmp_path_factory.mktemp("chatml"), CHATML, CHATML_SPECIALS)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "zerobatch.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_convert_chat_shows_progress_head_marks_trained_tokens_stats_counts_them(chatml, tmp_path):
    convs = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
             for i in range(40)]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs) + "\n\n")
    chat = ChatTemplate(chatml)
    masks = [chat.encode(m)[1] for m in convs]
    trained, total = sum(int(m.sum()) for m in masks), sum(m.size for m in masks)
    r = cli("convert", src, tmp_path / "ds", "--to", "tokstream", "--tokenizer", chatml, "--chat")
    assert r.returncode == 0, r.stderr
    # the text path's bar: input bytes (all of them, blank lines at the end too) and tokens
    assert "chat: 100%" in r.stderr and f"{total:,} tokens" in r.stderr, r.stderr
    r = cli("convert", src, tmp_path / "quiet", "--to", "tokstream", "--tokenizer", chatml, "--chat", "-q")
    assert r.returncode == 0 and "chat:" not in r.stderr, r.stderr
    # head: the folder taken as --tokenizer; trained text between brackets (no tty: no colour)
    r = cli("head", tmp_path / "ds", "-n", "2", "--tokenizer", chatml)
    assert r.returncode == 0, r.stderr
    assert "\x1b[" not in r.stdout
    assert "<|im_start|>assistant\n\u27e6answer 1<|im_end|>\n\u27e7" in r.stdout, r.stdout
    assert "<|im_start|>user\nquestion 1<|im_end|>\n<|im_start|>" in r.stdout
    r = cli("head", tmp_path / "ds", "-n", "1")
    assert r.returncode == 0 and "\u27e6" in r.stdout, r.stderr
    r = cli("stats", tmp_path / "ds", "--tokenizer", chatml)
    assert r.returncode == 0, r.stderr
    assert f"trained on (loss mask 1): {trained:,} of {total:,} tokens ({100 * trained / total:.2f} %)" in r.stdout
    # a dataset without a mask: no such line, nothing marked
    plain = tmp_path / "plain.txt"
    plain.write_text("hello world\n")
    assert cli("convert", plain, tmp_path / "p", "--to", "tokstream", "--tokenizer", chatml + "/tokenizer.json",
               "-q").returncode == 0
    r = cli("head", tmp_path / "p", "--tokenizer", chatml)
    assert r.returncode == 0 and "\u27e6" not in r.stdout and "hello world" in r.stdout, r.stderr
    assert "trained on" not in cli("stats", tmp_path / "p").stdout


def test_verify_and_inspect_check_the_loss_mask_too(tmp_path):
    """`zerobatch verify` checks a chat dataset's loss mask with its tokens: a flipped byte in
    the mask, or a mask of other documents, is a fault naming the mask; inspect shows it."""
    def build(folder, mask_lengths):
        with TokenStreamWriter(folder, vocab_size=100, shard_tokens=500) as w:
            for n in (30, 50, 70):
                w.add_document(np.arange(n) % 100)
        with TokenStreamWriter(folder / "loss_mask", vocab_size=2, shard_tokens=500) as w:
            for n in mask_lengths:
                w.add_document(np.arange(n) % 2)

    good = tmp_path / "good"
    build(good, (30, 50, 70))
    r = cli("verify", str(good))
    assert r.returncode == 0 and "its loss mask: 1 shards" in r.stdout, r.stdout + r.stderr
    assert "loss_mask" in cli("inspect", str(good)).stdout
    tokens = next((good / "loss_mask").glob("*/tokens.bin"))
    raw = bytearray(tokens.read_bytes())
    raw[40] ^= 1
    tokens.write_bytes(bytes(raw))
    r = cli("verify", str(good))
    assert r.returncode == 1 and "loss_mask" in r.stderr, r.stdout + r.stderr
    other = tmp_path / "other"
    build(other, (30, 120))
    r = cli("verify", str(other))
    assert r.returncode == 1 and "a mask of another dataset" in r.stderr, r.stdout + r.stderr


def test_show_trained_cuts_and_colours():
    dec = lambda ids: "".join(chr(96 + i) for i in ids)   # noqa: E731
    ids, mask = [1, 2, 3, 4, 5], np.array([0, 1, 1, 0, 1])
    assert show_trained(ids, mask, dec) == "a\u27e6bc\u27e7d\u27e6e\u27e7"
    assert show_trained(ids, mask, dec, chars=2) == "a\u27e6b\u27e7 [...]"
    assert show_trained(ids, mask, dec, colour=True) == "a\x1b[1;32mbc\x1b[0md\x1b[1;32me\x1b[0m"
    assert show_trained(ids, mask, None) == "1 \u27e62 3\u27e7 4 \u27e65\u27e7"
    assert show_trained([], np.zeros(0), dec) == ""

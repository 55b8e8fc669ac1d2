"""``convert`` with every tokenizer kind, against the real libraries: tiktoken's GPT-2 encoding
(nanoGPT's), a SentencePiece model, a user function; special-token text stays ordinary text in
every backend (``stats --tokenizer`` showing decoded text: tests/cli/test_commands.py)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerobatch.prepare.pipeline import convert
from zerobatch.prepare.tokenizer import load_tokenizer
from zerobatch.formats.errors import ConfigError, NotFoundError
from zerobatch.readers.tokstream import TokenStreamReader

FIXTURE = Path(__file__).parent.parent / "fixtures" / "tiktoken" / "r50k_base.tiktoken.gz"

TEXTS = ["Hello world, this is nanoGPT's tokenizer.", "A literal <|endoftext|> inside text stays text.",
         "  spaces\tand\nnewlines  ", "unicode: café ☕ 東京"]


@pytest.fixture(scope="module")
def tiktoken_cache(tmp_path_factory):
    """A TIKTOKEN_CACHE_DIR holding GPT-2's ranks under the name tiktoken gives their URL."""
    pytest.importorskip("tiktoken")
    import inspect
    import re

    from tiktoken_ext import openai_public

    # the cache key tiktoken derives from the file's address (read from tiktoken's own source,
    # so the test follows it); nothing is fetched
    (url,) = re.findall(r'"(https://[^"]+r50k_base\.tiktoken)"', inspect.getsource(openai_public.r50k_base))
    d = tmp_path_factory.mktemp("tiktoken-cache")
    (d / hashlib.sha1(url.encode()).hexdigest()).write_bytes(gzip.decompress(FIXTURE.read_bytes()))
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(d)
    yield str(d)
    if old is None:
        del os.environ["TIKTOKEN_CACHE_DIR"]
    else:
        os.environ["TIKTOKEN_CACHE_DIR"] = old


def jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def docs(path: Path) -> list[list[int]]:
    with TokenStreamReader(path) as r:
        return [r.document(i).tolist() for i in range(r.num_documents)]


def test_tiktoken_gpt2_ids_equal_tiktoken_s_own(tiktoken_cache, tmp_path):
    import tiktoken

    enc = tiktoken.get_encoding("r50k_base")      # loaded from the cache, its hash checked
    assert enc.n_vocab == 50257 and enc.eot_token == 50256
    src = jsonl(tmp_path / "t.jsonl", TEXTS)
    lines: list[str] = []
    convert(str(src), str(tmp_path / "t.ts"), to="tokstream", tokenizer="tiktoken:r50k_base", workers=1,
            quiet=True, log=lines.append)
    # nanoGPT's prepare.py: enc.encode_ordinary(text), then the end-of-text token
    assert docs(tmp_path / "t.ts") == [enc.encode_ordinary(t) + [enc.eot_token] for t in TEXTS]
    assert 50256 not in docs(tmp_path / "t.ts")[1][:-1]   # the literal never forges a boundary
    with TokenStreamReader(tmp_path / "t.ts") as r:
        assert r.manifest.vocab_size == 50257
    with pytest.raises(ConfigError, match="Unknown encoding"):
        load_tokenizer("tiktoken:no_such_encoding")


def test_tiktoken_without_its_file_is_a_typed_error(tmp_path):
    pytest.importorskip("tiktoken")
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(tmp_path), "HTTPS_PROXY": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9"}
    r = subprocess.run([sys.executable, "-c", "from zerobatch.prepare.tokenizer import load_tokenizer\n"
                        "from zerobatch.formats.errors import NotFoundError\n"
                        "try:\n    load_tokenizer('tiktoken:r50k_base')\nexcept NotFoundError as e:\n"
                        "    print('typed', e.field)"], capture_output=True, text=True, timeout=120, env=env)
    assert r.stdout.strip() == "typed tokenizer", r.stderr
    assert NotFoundError


def test_hf_tokenizers_keep_special_token_text_ordinary(tmp_path):
    from zerobatch.cli.quickstart import bundled_text, train_tokenizer

    (tmp_path / "c.txt").write_text(bundled_text()[:20_000])
    tok = train_tokenizer(str(tmp_path / "c.txt"), 300, str(tmp_path / "tok.json"))
    eod = tok.token_to_id("<|endoftext|>")
    src = jsonl(tmp_path / "h.jsonl", TEXTS[1:2])
    convert(str(src), str(tmp_path / "h.ts"), to="tokstream", tokenizer=str(tmp_path / "tok.json"), workers=1,
            quiet=True, log=lambda s: None)
    (doc,) = docs(tmp_path / "h.ts")
    assert doc[-1] == eod and eod not in doc[:-1]
    assert load_tokenizer(str(tmp_path / "tok.json")).decode(doc[:-1]) == TEXTS[1]


def test_sentencepiece_model_with_bos(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    from zerobatch.cli.quickstart import bundled_text

    (tmp_path / "c.txt").write_text(bundled_text()[:40_000])
    spm.SentencePieceTrainer.train(input=str(tmp_path / "c.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=300,
                                   minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    texts = ["To be, or not to be", "that is the question </s> here"]
    src = jsonl(tmp_path / "s.jsonl", texts)
    convert(str(src), str(tmp_path / "s.ts"), to="tokstream", tokenizer=str(tmp_path / "sp.model"), add_bos=True,
            workers=1, quiet=True, log=lambda s: None)
    assert docs(tmp_path / "s.ts") == [[sp.bos_id(), *sp.encode(t), sp.eos_id()] for t in texts]


def whitespace_ids(texts: list[str]) -> list[list[int]]:
    """A custom tokenizer: one id per word, its length."""
    return [[1 + len(w) for w in t.split()] for t in texts]


def test_a_tokenize_function_in_the_python_api(tmp_path):
    src = jsonl(tmp_path / "f.jsonl", ["a bb ccc", "dddd"])
    convert(str(src), str(tmp_path / "f.ts"), to="tokstream", tokenizer=whitespace_ids, eod_id=0, workers=1,
            quiet=True, log=lambda s: None)
    assert docs(tmp_path / "f.ts") == [[2, 3, 4, 0], [5, 0]]
    with pytest.raises(ConfigError, match="eod"):
        convert(str(src), str(tmp_path / "g.ts"), to="tokstream", tokenizer=whitespace_ids, workers=1, quiet=True)
    with pytest.raises(ConfigError, match="returned 1 id lists for 2 texts"):
        convert(str(src), str(tmp_path / "g.ts"), to="tokstream", tokenizer=lambda t: [[1]], eod_id=0, workers=1,
                quiet=True, log=lambda s: None)

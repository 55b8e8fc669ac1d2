"""convert --chat: conversations rendered with the tokenizer folder's chat template give the ids
of transformers' apply_chat_template token for token, and a loss mask equal to its assistant
mask (the {% generation %} marks), for conversations of system, user, assistant and tool
messages, empty messages and unicode (hypothesis); the mask is stored beside the tokens and
the loaders turn it into labels of -100."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")

from zerobatch.cli.chat import ChatTemplate  # noqa: E402
from zerobatch.cli.convert import convert  # noqa: E402
from zerobatch.cli.quickstart import bundled_text, train_tokenizer  # noqa: E402
from zerobatch.formats.errors import ConfigError, CorruptError  # noqa: E402
from zerobatch.readers.tokstream import TokenStreamReader, open_loss_mask  # noqa: E402

CHATML = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
          "{%- if message['role'] == 'assistant' %}{% generation %}{{ (message['content'] or '') + '<|im_end|>\\n' }}"
          "{% endgeneration %}{%- else %}{{ (message['content'] or '') + '<|im_end|>\\n' }}{%- endif %}"
          "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA = ("{{ bos_token }}{%- for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
         "'<|end_header_id|>\\n\\n' }}{%- if message['role'] == 'assistant' %}{% generation %}"
         "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{%- else %}"
         "{{ message['content'] | trim + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
         "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


def make_tokenizer(folder, template, specials):
    from tokenizers import Tokenizer
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "t.txt").write_text(bundled_text()[:60_000])
    train_tokenizer(str(folder / "t.txt"), 400, str(folder / "tokenizer.json"))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(list(specials.values()))
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast", **specials}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("chatml"), CHATML,
                          {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<|im_start|>"})


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("llama"), LLAMA,
                          {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                           "pad_token": "<|start_header_id|>", "unk_token": "<|end_header_id|>"})


def reference(folder, messages):
    """transformers' ids and assistant mask."""
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                                           "content": st.one_of(texts, st.sampled_from(["", "héllo wörld ✓ 你好 🙂"]))}),
                    min_size=1, max_size=6)


@pytest.mark.parametrize("which", ["chatml", "llama"])
def test_ids_and_mask_equal_transformers_on_random_conversations(which, request):
    folder = request.getfixturevalue(which)
    chat = ChatTemplate(folder)

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(messages)
    def check(msgs):
        ids, mask = chat.encode(msgs)
        want_ids, want_mask = reference(folder, msgs)
        assert ids.tolist() == want_ids
        assert mask.tolist() == want_mask
    check()


def test_roles_choose_what_is_trained_on(chatml):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "tool", "content": "{\"t\": 21}"},
            {"role": "assistant", "content": "It is 21."}]
    ids, only = ChatTemplate(chatml).encode(msgs)
    _, both = ChatTemplate(chatml, roles=("assistant", "tool")).encode(msgs)
    assert only.sum() > 0 and both.sum() > only.sum() and (both >= only).all()
    tok = transformers.AutoTokenizer.from_pretrained(chatml)
    assert tok.decode(ids[only.astype(bool)].tolist()) == "Hello!<|im_end|>\nIt is 21.<|im_end|>\n"


def test_convert_chat_writes_the_mask_and_the_loaders_use_it(chatml, tmp_path):
    from zerobatch.adapters.torch import Loader, PackedDocuments, TokenDocuments, TokenWindows
    convs = [[{"role": "user", "content": f"question {i} " * (i % 5 + 1)},
              {"role": "assistant", "content": f"answer {i} ✓ " * (i % 3 + 1)}] for i in range(60)]
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs) + "\n")
    dst = tmp_path / "ds"
    r = subprocess.run([sys.executable, "-m", "zerobatch.cli", "convert", str(src), str(dst), "--to", "tokstream",
                        "--tokenizer", chatml, "--chat"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "60 conversations" in r.stdout, r.stderr
    chat = ChatTemplate(chatml)
    with TokenStreamReader(dst) as reader, open_loss_mask(reader) as mask:
        assert reader.num_documents == 60
        for i in (0, 17, 59):
            ids, m = chat.encode(convs[i])
            assert reader.document(i).tolist() == ids.tolist() and mask.document(i).tolist() == m.tolist()
    r = subprocess.run([sys.executable, "-m", "zerobatch.cli", "verify", str(dst)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr

    def trained(reader, mask):
        """The (token, next token) pairs the mask trains on: next token masked in."""
        pairs = set()
        for i in range(reader.num_documents):
            t, m = reader.document(i), mask.document(i)
            pairs |= {(int(t[j]), int(t[j + 1]), i) for j in range(t.size - 1) if m[j + 1]}
        return pairs
    for src_ in (PackedDocuments(str(dst), 64, loss_mask=True, buffer=8),
                 TokenDocuments(str(dst), 80, loss_mask=True), TokenWindows(str(dst), 48, loss_mask=True)):
        kept = masked = 0
        for b in Loader(src_, batch_size=4, tail="keep", shuffle=False):
            y = b["labels"]
            kept += int((y != -100).sum())
            masked += int((y == -100).sum())
        assert kept > 0 and masked > 0, type(src_).__name__
    # the packed rows' labels keep exactly the masked-in next tokens (each once)
    with TokenStreamReader(dst) as reader, open_loss_mask(reader) as mask:
        want = sum(int(mask.document(i)[1:].sum()) for i in range(reader.num_documents))
    got = 0
    for b in Loader(PackedDocuments(str(dst), 64, loss_mask=True, buffer=8), batch_size=4, tail="keep"):
        got += int((b["labels"] != -100).sum())
    assert got <= want and got >= want - 60 * 2     # a split conversation loses its cut's label


def assert_same_chat_data(first, second, count):
    """Two chat datasets hold ``count`` conversations with equal tokens and loss masks."""
    with TokenStreamReader(first) as a, TokenStreamReader(second) as b, \
            open_loss_mask(a) as ma, open_loss_mask(b) as mb:
        assert a.num_documents == b.num_documents == count
        for i in range(count):
            assert a.document(i).tolist() == b.document(i).tolist()
            assert ma.document(i).tolist() == mb.document(i).tolist()


def test_parquet_conversations_equal_jsonl_ones(chatml, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    convs = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"q{i} ünï"},
              {"role": "assistant", "content": f"a{i}"}] for i in range(30)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
    pq.write_table(pa.table({"messages": convs}), tmp_path / "c.parquet", row_group_size=7)
    for name in ("c.jsonl", "c.parquet"):
        convert(str(tmp_path / name), str(tmp_path / f"out-{name}"), to="tokstream", tokenizer=chatml, chat=True,
                log=lambda *_: None)
    assert_same_chat_data(tmp_path / "out-c.jsonl", tmp_path / "out-c.parquet", 30)


def test_bad_chat_inputs_are_refused(chatml, tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"messages": "not a list"}) + "\n")
    with pytest.raises(CorruptError, match="messages"):
        convert(str(src), str(tmp_path / "o"), to="tokstream", tokenizer=chatml, chat=True, log=lambda *_: None)
    src.write_text(json.dumps({"text": "no messages"}) + "\n")
    with pytest.raises(CorruptError, match="no field 'messages'"):
        convert(str(src), str(tmp_path / "o"), to="tokstream", tokenizer=chatml, chat=True, log=lambda *_: None)
    with pytest.raises(ConfigError, match="--chat"):
        convert(str(src), str(tmp_path / "o"), to="llmbatch", tokenizer=chatml, chat=True, log=lambda *_: None)
    odd = tmp_path / "odd"
    make_tokenizer(odd, "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
                   {"eos_token": "<|im_end|>"})
    with pytest.raises(ConfigError, match="not a prefix"):
        ChatTemplate(str(odd)).encode([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])


def test_worker_processes_convert_chat_as_one_process_does(chatml, tmp_path, monkeypatch):
    import zerobatch.cli.convert as conv
    monkeypatch.setattr(conv, "CHAT_GROUP", 8)          # 100 conversations: 13 groups over 2 processes
    import zerobatch.cli.workers as workers_module
    started = []
    real = workers_module.mp.get_context
    monkeypatch.setattr(workers_module.mp, "get_context", lambda method: started.append(method) or real(method))
    convs = [[{"role": "user", "content": f"q{i} " * (i % 7)}, {"role": "assistant", "content": f"a{i} ✓" * (i % 4)}]
             for i in range(100)]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
    for workers in (1, 2):
        convert(str(src), str(tmp_path / f"w{workers}"), to="tokstream", tokenizer=chatml, chat=True, workers=workers,
                log=lambda *_: None)
    assert_same_chat_data(tmp_path / "w1", tmp_path / "w2", 100)
    assert started == ["forkserver"]                    # workers=2 started a pool, workers=1 none
    # a bad record in a worker's group is reported by file and line
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs[:50]) + '{"messages": 3}\n')
    with pytest.raises(CorruptError, match="c.jsonl line 51"):
        convert(str(src), str(tmp_path / "bad"), to="tokstream", tokenizer=chatml, chat=True, workers=2,
                log=lambda *_: None)
    assert not (tmp_path / "bad").exists()


def test_chat_tasks_and_commit_give_the_dataset_and_mask_of_one_process(chatml, tmp_path, s3_endpoint, monkeypatch):
    """convert --chat --task I --tasks N over a JSONL file cut into byte ranges and a Parquet
    file split by row group: for N = 1 and 3 (tasks in any order), after commit, the dataset
    and its loss mask equal a one-process conversion, file for file across N; commit refuses
    while a task is missing (no manifest in either stream) and works at an s3:// URL too."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from zerobatch.cli.tasks import commit
    convs = [[{"role": "user", "content": f"question {i} " * (i % 6 + 1)},
              {"role": "assistant", "content": f"answer {i} ✓ " * (i % 4 + 1)}] for i in range(120)]
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs[:80]))
    pq.write_table(pa.table({"messages": convs[80:]}), src / "b.parquet", row_group_size=9)
    one = tmp_path / "one"
    convert(str(src), str(one), to="tokstream", tokenizer=chatml, chat=True, log=lambda *_: None)
    opts = dict(to="tokstream", tokenizer=chatml, chat=True, unit_bytes=2048, shard_tokens=1500, workers=1,
                quiet=True, log=lambda *_: None)
    files = {}
    for n, order in ((1, [0]), (3, [2, 0, 1])):
        dst = tmp_path / f"n{n}"
        for i in order:
            if n == 3 and i == 1:
                with pytest.raises(ConfigError, match="run these of the 3 tasks again: 1"):
                    commit(str(dst), log=lambda *_: None)
                assert not (dst / "manifest.json").exists() and not (dst / "loss_mask" / "manifest.json").exists()
            convert(str(src), str(dst), task=i, tasks=n, **opts)
        commit(str(dst), log=lambda *_: None)
        assert_same_chat_data(one, dst, 120)
        files[n] = {str(p.relative_to(dst)): p.read_bytes() for p in sorted(dst.rglob("*")) if p.is_file()}
        assert not any(k.startswith("_parts") or "/_parts" in k for k in files[n])
    assert files[1] == files[3]
    # the same at a URL: the mask's manifest, then the dataset's
    from s3kit import new_bucket
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL": s3_endpoint, "AWS_ALLOW_HTTP": "true",
                 "ZEROBATCH_CACHE_DIR": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(k, v)
    url = f"s3://{new_bucket(s3_endpoint)}/sft"
    for i in range(2):
        convert(str(src), url, task=i, tasks=2, **opts)
    commit(url, log=lambda *_: None)
    assert_same_chat_data(one, url, 120)


def test_verify_and_inspect_check_the_loss_mask_too(tmp_path):
    """`zerobatch verify` checks a chat dataset's loss mask with its tokens: a flipped byte in
    the mask, or a mask of other documents, is a fault naming the mask; inspect shows it."""
    import numpy as np

    from zerobatch.writers.tokstream import TokenStreamWriter

    def build(folder, mask_lengths):
        with TokenStreamWriter(folder, vocab_size=100, shard_tokens=500) as w:
            for n in (30, 50, 70):
                w.add_document(np.arange(n) % 100)
        with TokenStreamWriter(folder / "loss_mask", vocab_size=2, shard_tokens=500) as w:
            for n in mask_lengths:
                w.add_document(np.arange(n) % 2)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "zerobatch.cli", *args], capture_output=True, text=True,
                              timeout=120)
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

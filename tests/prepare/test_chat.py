"""convert --chat: conversations rendered with the tokenizer folder's chat template give the ids
of transformers' apply_chat_template token for token, and a loss mask equal to its assistant
mask (the {% generation %} marks), for conversations of system, user, assistant and tool
messages, empty messages and unicode (hypothesis); the mask is stored beside the tokens and
the loaders turn it into labels of -100. Also (issue 30): the mask on Qwen2/ChatML and Llama-3
templates, with and without marks and add_generation_prompt branches, with a Qwen2-style
tokenizer that merges newlines across a mark; content as a list of parts, template errors and
undecodable text as typed errors through the command; a tokenizer folder as a tokenizer.
What the commands show and check of a chat dataset (verify, inspect, head, stats, the
progress bar) is tests/cli/test_chat_commands.py."""

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

from zerobatch.prepare.chat import ChatTemplate  # noqa: E402
from zerobatch.prepare.pipeline import convert  # noqa: E402
from zerobatch.cli.quickstart import bundled_text  # noqa: E402
from zerobatch.formats.errors import ConfigError, CorruptError  # noqa: E402
from zerobatch.readers.tokstream import TokenStreamReader, open_loss_mask  # noqa: E402
from zbtest import CHATML, CHATML_SPECIALS, chat_tokenizer  # noqa: E402

LLAMA = ("{{ bos_token }}{%- for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
         "'<|end_header_id|>\\n\\n' }}{%- if message['role'] == 'assistant' %}{% generation %}"
         "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{%- else %}"
         "{{ message['content'] | trim + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
         "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return chat_tokenizer(tmp_path_factory.mktemp("chatml"), CHATML, CHATML_SPECIALS)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return chat_tokenizer(tmp_path_factory.mktemp("llama"), LLAMA,
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
        # each dataset names its own mask's build id (convert --chat and commit bind them)
        assert a.manifest.loss_mask == ma.manifest.build_id and b.manifest.loss_mask == mb.manifest.build_id
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
    damaged = tmp_path / "damaged.parquet"          # not a Parquet file: pyarrow's error, typed
    damaged.write_bytes(b"PAR1" + bytes(60))
    with pytest.raises(CorruptError, match="parquet: ") as e:
        convert(str(damaged), str(tmp_path / "o"), to="tokstream", tokenizer=chatml, chat=True, log=lambda *_: None)
    assert e.value.path == str(damaged)
    odd = tmp_path / "odd"
    chat_tokenizer(odd, "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
                   {"eos_token": "<|im_end|>"})
    with pytest.raises(ConfigError, match="not a prefix"):
        ChatTemplate(str(odd)).encode([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])


def test_worker_processes_convert_chat_as_one_process_does(chatml, tmp_path, monkeypatch):
    import zerobatch.prepare.encoders as conv
    monkeypatch.setattr(conv, "CHAT_GROUP", 8)          # 100 conversations: 13 groups over 2 processes
    import zerobatch.prepare.workers as workers_module
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


def test_an_interrupted_chat_conversion_resumes_from_its_staged_groups(chatml, tmp_path, monkeypatch):
    """--chat runs the text path's pipeline: its groups are staged in DST.zbconvert, kept when
    the run is interrupted, and a rerun encodes none again and writes the same dataset."""
    import zerobatch.prepare.pipeline as pipeline
    import zerobatch.prepare.encoders as conv
    monkeypatch.setattr(conv, "CHAT_GROUP", 8)
    convs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i} " * (i % 5)}]
             for i in range(40)]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
    convert(str(src), str(tmp_path / "one"), to="tokstream", tokenizer=chatml, chat=True, workers=1, quiet=True,
            log=lambda *_: None)
    real = pipeline.write_target

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(pipeline, "write_target", interrupted)
    lines = []
    with pytest.raises(KeyboardInterrupt):
        convert(str(src), str(tmp_path / "two"), to="tokstream", tokenizer=chatml, chat=True, workers=1, quiet=True,
                log=lines.append)
    assert any("the tokenized groups are kept" in ln for ln in lines), lines
    assert (tmp_path / "two.zbconvert").is_dir() and not (tmp_path / "two").exists()
    monkeypatch.setattr(pipeline, "write_target", real)
    lines.clear()
    convert(str(src), str(tmp_path / "two"), to="tokstream", tokenizer=chatml, chat=True, workers=1, quiet=True,
            log=lines.append)
    assert any(ln.startswith("resumed: 5 of 5 tokenized groups") for ln in lines), lines
    assert not (tmp_path / "two.zbconvert").exists()
    assert_same_chat_data(tmp_path / "one", tmp_path / "two", sum(1 for m in convs if m))


def test_chat_tasks_and_commit_give_the_dataset_and_mask_of_one_process(chatml, tmp_path, s3_endpoint, monkeypatch):
    """convert --chat --task I --tasks N over a JSONL file cut into byte ranges and a Parquet
    file split by row group: for N = 1 and 3 (tasks in any order), after commit, the dataset
    and its loss mask equal a one-process conversion, file for file across N; commit refuses
    while a task is missing (no manifest in either stream) and works at an s3:// URL too."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from zerobatch.prepare.tasks import commit
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
                with pytest.raises(ConfigError, match=r"of task 1 of 3\); that task may still be running"):
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


# ---------------------------------------------------------------------------------------------
# The loss mask follows {% generation %} marks exactly as transformers does (issue 30): the "\n"
# a Qwen2/ChatML template writes after <|im_end|> outside the marks is not trained on; a reply
# starting with "\n" whose first token merges with the header's "\n" is; a template without an
# add_generation_prompt branch does not train the role header. Templates without marks: the
# message's text less its header, equal to transformers' mask on the same template with marks.

QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def chatml_template(marks, prompt=True, newline_in_marks=False):
    """A ChatML template as Qwen2's: ``marks`` around an assistant reply and its <|im_end|>
    (and its "\\n" with ``newline_in_marks``); ``prompt``: an add_generation_prompt branch."""
    body = "message['content'] + '<|im_end|>'" + (" + '\\n'" if newline_in_marks else "")
    tail = "" if newline_in_marks else "{{- '\\n' }}"
    reply = (f"{{% generation %}}{{{{- {body} }}}}{{% endgeneration %}}{tail}" if marks
             else f"{{{{- {body} }}}}{tail}")
    return ("{%- for message in messages %}{%- if message['role'] == 'assistant' %}"
            "{{- '<|im_start|>assistant\\n' }}" + reply + "{%- else %}"
            "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
            "{%- endif %}{%- endfor %}"
            + ("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}" if prompt else ""))


def llama_template(marks, prompt=True):
    reply = "{{ message['content'] | trim + '<|eot_id|>' }}"
    return ("{{ bos_token }}{%- for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
            "'<|end_header_id|>\\n\\n' }}{%- if message['role'] == 'assistant' %}"
            + (f"{{% generation %}}{reply}{{% endgeneration %}}" if marks else reply) +
            "{%- else %}{{ message['content'] | trim + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
            + ("{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
               "{%- endif %}" if prompt else ""))


LLAMA_SPECIALS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|start_header_id|>",
                  "unk_token": "<|end_header_id|>"}


def make_qwen_tokenizer(folder, template, specials):
    """A byte-level BPE trained here (nothing downloaded) with Qwen2's pre-tokenizer, which keeps
    runs of newlines together: "assistant\\n" + "\\nHello" gives one "\\n\\n" token across the
    header and the reply."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([bundled_text()[:60_000]], trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens(list(dict.fromkeys(specials.values())))
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast", **specials}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


_REFERENCE_TOKENIZERS = {}


def reference_with(folder, messages, template=None):
    """transformers' ids and assistant mask, with ``template`` instead of the folder's."""
    if folder not in _REFERENCE_TOKENIZERS:
        _REFERENCE_TOKENIZERS[folder] = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    out = _REFERENCE_TOKENIZERS[folder].apply_chat_template(
        messages, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


TEMPLATES = {   # name: (template, specials, the marked twin transformers' mask is compared with)
    "qwen-marks": (chatml_template(True), CHATML_SPECIALS, None),
    "qwen-marks-no-prompt": (chatml_template(True, prompt=False), CHATML_SPECIALS, None),
    "llama-marks": (llama_template(True), LLAMA_SPECIALS, None),
    "llama-marks-no-prompt": (llama_template(True, prompt=False), LLAMA_SPECIALS, None),
    "chatml-plain": (chatml_template(False, newline_in_marks=True), CHATML_SPECIALS,
                     chatml_template(True, newline_in_marks=True)),
    "chatml-plain-no-prompt": (chatml_template(False, prompt=False, newline_in_marks=True), CHATML_SPECIALS,
                               chatml_template(True, newline_in_marks=True)),
    "llama-plain": (llama_template(False), LLAMA_SPECIALS, llama_template(True)),
    "llama-plain-no-prompt": (llama_template(False, prompt=False), LLAMA_SPECIALS, llama_template(True)),
}


@pytest.fixture(scope="module")
def qwen_folders(tmp_path_factory):
    return {name: make_qwen_tokenizer(tmp_path_factory.mktemp(name), template, specials)
            for name, (template, specials, _) in TEMPLATES.items()}


lines = st.text(st.sampled_from(list("ab \n\t.é✓")), max_size=12)
replies = st.one_of(texts, lines, lines.map(lambda t: "\n" + t), lines.map(lambda t: "\n\n" + t))
turns = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                                        "content": replies}), min_size=1, max_size=6)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_mask_equals_transformers_on_qwen_llama_templates_with_and_without_marks(name, qwen_folders):
    folder = qwen_folders[name]
    twin = TEMPLATES[name][2]
    chat = ChatTemplate(folder)
    assert chat.marks == (twin is None)

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(turns)
    def check(msgs):
        ids, mask = chat.encode(msgs)
        want_ids, want_mask = reference_with(folder, msgs, twin)
        assert ids.tolist() == want_ids
        assert mask.tolist() == want_mask
    check()


@pytest.mark.parametrize("name", ["qwen-marks", "qwen-marks-no-prompt", "chatml-plain-no-prompt"])
def test_the_three_reported_cases(name, qwen_folders):
    """(a) the "\\n" after an assistant <|im_end|> outside the marks is not trained on; (b) a
    reply starting with "\\n" (one "\\n\\n" token with the header's) is; (c) without an
    add_generation_prompt branch no role header is."""
    folder = qwen_folders[name]
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\nHello"},
            {"role": "user", "content": "and?"}, {"role": "assistant", "content": "Bye"}]
    chat = ChatTemplate(folder)
    ids, mask = chat.encode(msgs)
    want_ids, want_mask = reference_with(folder, msgs, TEMPLATES[name][2])
    assert ids.tolist() == want_ids and mask.tolist() == want_mask
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    pieces = tok.convert_ids_to_tokens(ids.tolist())
    trained = [p for p, m in zip(pieces, mask.tolist(), strict=True) if m]
    assert "ĊĊ" in trained                                               # (b)
    assert "assistant" not in tok.decode([i for i, m in zip(ids.tolist(), mask.tolist()) if m])   # (c)
    if chat.marks:                                                        # (a)
        assert tok.decode(ids[mask.astype(bool)].tolist()) == "\n\nHello<|im_end|>Bye<|im_end|>"
        ends = [k for k, p in enumerate(pieces) if p == "<|im_end|>"]
        assert all(mask[k + 1] == 0 for k in ends if k + 1 < len(pieces))


def test_other_roles_beside_marks_are_found_without_their_header(qwen_folders):
    folder = qwen_folders["qwen-marks"]
    msgs = [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "{\"t\": 21}"},
            {"role": "assistant", "content": "It is 21."}]
    ids, mask = ChatTemplate(folder, roles=("assistant", "tool")).encode(msgs)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    assert tok.decode(ids[mask.astype(bool)].tolist()) == "{\"t\": 21}<|im_end|>\nIt is 21.<|im_end|>"
    _, only_tool = ChatTemplate(folder, roles=("tool",)).encode(msgs)
    assert tok.decode(ids[only_tool.astype(bool)].tolist()) == "{\"t\": 21}<|im_end|>\n"


PARTS_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{- '\\n' }}{%- elif message['content'] is string %}"
    "{{- message['content'] + '<|im_end|>\\n' }}{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- elif part['type'] == 'image_url' %}"
    "{{- '<|endoftext|>' }}{%- endif %}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}")
PARTS = [{"role": "user", "content": [{"type": "text", "text": "What is in "},
                                      {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                                      {"type": "text", "text": " this?"}]},
         {"role": "assistant", "content": "A cat."}]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "zerobatch.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_content_as_a_list_of_parts(qwen_folders, tmp_path):
    """Parts reach the template as transformers passes them; a template that takes only
    strings fails with an error naming the file, line and message, not an internal error."""
    parts_folder = make_qwen_tokenizer(tmp_path / "parts", PARTS_TEMPLATE, CHATML_SPECIALS)
    ids, mask = ChatTemplate(parts_folder).encode(PARTS)
    assert (ids.tolist(), mask.tolist()) == reference_with(parts_folder, PARTS)
    src = tmp_path / "parts.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}]})
                   + "\n" + json.dumps({"messages": PARTS}) + "\n")
    r = cli("convert", src, tmp_path / "ok", "--to", "tokstream", "--tokenizer", parts_folder, "--chat", "-q")
    assert r.returncode == 0, r.stderr
    with TokenStreamReader(tmp_path / "ok") as reader:
        assert reader.document(1).tolist() == ids.tolist()
    r = cli("convert", src, tmp_path / "bad", "--to", "tokstream", "--tokenizer", qwen_folders["qwen-marks"],
            "--chat", "-q")
    assert r.returncode == 1 and "internal error" not in r.stderr, r.stderr
    assert "error: parts.jsonl line 2: message 0: the chat template cannot render it (TypeError" in r.stderr
    assert "list of parts" in r.stderr and not (tmp_path / "bad").exists()
    with pytest.raises(CorruptError, match=r"x line 9: message 0: the chat template cannot render it"):
        ChatTemplate(qwen_folders["qwen-marks"]).encode(PARTS, where="x line 9")


def test_raise_exception_in_a_template_is_a_typed_error_naming_the_message(tmp_path):
    strict = make_qwen_tokenizer(tmp_path / "strict", "{%- for m in messages %}{%- if m['role'] == 'tool' %}"
                                 "{{ raise_exception('no tools here') }}{%- endif %}{{ m['content'] }}{%- endfor %}",
                                 CHATML_SPECIALS)
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "tool", "content": "c"}]
    with pytest.raises(CorruptError, match=r"c.jsonl line 4: message 2: the chat template cannot render it "
                                           r"\(no tools here\)"):
        ChatTemplate(strict).encode(msgs, where="c.jsonl line 4")


def test_lone_surrogates_and_bad_utf8_follow_text_errors(chatml, tmp_path):
    src = tmp_path / "s.jsonl"
    good = {"messages": [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "fine"}]}
    src.write_bytes(json.dumps(good).encode() + b"\n"
                    + b'{"messages": [{"role": "user", "content": "pair \\ud83d\\ude00 lone \\ud800"}, '
                      b'{"role": "assistant", "content": "yes"}]}\n'
                    + b'{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "b\xffd"}]}\n')
    r = cli("convert", src, tmp_path / "rep", "--to", "tokstream", "--tokenizer", chatml, "--chat", "-q")
    assert r.returncode == 0 and "internal error" not in r.stderr, r.stderr
    assert "2 conversations had undecodable text" in r.stdout + r.stderr
    chat = ChatTemplate(chatml)
    with TokenStreamReader(tmp_path / "rep") as reader, open_loss_mask(reader) as mask:
        assert reader.num_documents == 3
        for i, msgs in ((1, [{"role": "user", "content": "pair \U0001f600 lone \ufffd"},
                             {"role": "assistant", "content": "yes"}]),
                        (2, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "b\ufffdd"}])):
            ids, m = chat.encode(msgs)
            assert reader.document(i).tolist() == ids.tolist() and mask.document(i).tolist() == m.tolist()
    r = cli("convert", src, tmp_path / "strict", "--to", "tokstream", "--tokenizer", chatml, "--chat", "-q",
            "--text-errors", "strict")
    assert r.returncode == 1 and "internal error" not in r.stderr, r.stderr
    assert "s.jsonl: line 2: message 0: holds a lone UTF-16 surrogate" in r.stderr, r.stderr
    src.write_bytes(json.dumps(good).encode() + b"\n" + b'{"messages": [{"role": "user", "content": "b\xffd"}]}\n')
    r = cli("convert", src, tmp_path / "strict2", "--to", "tokstream", "--tokenizer", chatml, "--chat", "-q",
            "--text-errors", "strict")
    assert r.returncode == 1 and "s.jsonl: line 2: byte 44 of it is not UTF-8" in r.stderr, r.stderr
    # from Python, a surrogate the caller left in is a typed error too
    with pytest.raises(CorruptError, match="message 1: holds a lone UTF-16 surrogate"):
        chat.encode([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b\ud800"}])


def test_a_tokenizer_folder_for_head_and_stats(chatml, tmp_path):
    from zerobatch.prepare.tokenizer import load_tokenizer
    from zerobatch.formats.errors import NotFoundError
    assert load_tokenizer(chatml).fingerprint == load_tokenizer(chatml + "/tokenizer.json").fingerprint
    with pytest.raises(NotFoundError, match="the folder holds no tokenizer.json"):
        load_tokenizer(tmp_path)

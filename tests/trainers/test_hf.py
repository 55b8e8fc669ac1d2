"""Hugging Face: the real Trainer, TRL's SFTTrainer and an accelerate loop train on zerobatch data,
are killed with SIGKILL after a checkpoint and resume from their own checkpoints; what the model
received is, call for call, what an uninterrupted run received. And the batches are what Hugging
Face's own collator makes of the same documents."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402
import trainerkit  # noqa: E402
from trainerkit import HERE, assert_resumed_exactly, merge_ranks, recorded, run  # noqa: E402
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402
from zbtest import token_stream  # noqa: E402

from zerobatch.adapters.hf import TrainerData, ZerobatchCallback, attach, hf_batch  # noqa: E402
from zerobatch.adapters.torch import Loader, Mixture, PackedDocuments, TokenDocuments, TokenWindows  # noqa: E402
from zerobatch.formats.errors import ConfigError, StateError  # noqa: E402

TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _three_runs(tmp_path, script, data, extra, steps, die_at):
    """Uninterrupted on 1 process; on 2 processes killed after the checkpoint of ``die_at``;
    resumed from it on 1 process: the forward calls of each (merged over ranks)."""
    full, kill, res = tmp_path / "full", tmp_path / "kill", tmp_path / "res"
    base = [str(HERE / script), data]
    run(base + [str(tmp_path / "a"), "--steps", str(steps), *extra], record=full)
    run(TORCHRUN + base + [str(tmp_path / "b"), "--steps", str(steps), "--die-at", str(die_at), *extra],
        record=kill, expect_killed=True)
    run(base + [str(tmp_path / "b"), "--steps", str(steps), "--resume", *extra], record=res)
    return recorded(full), merge_ranks([recorded(kill, 0), recorded(kill, 1)]), recorded(res)


@pytest.mark.timeout(600)
def test_trainer_on_2_processes_killed_resumes_exactly_on_1(tmp_path):
    """HF Trainer, gradient accumulation 2, 2 processes on gloo killed at step 6 (mid-epoch),
    resumed on 1 from the trainer's own checkpoint up to step 14: across the end of the epoch
    (50 windows, 4 per step: an accumulation group spans it), call for call the uninterrupted run."""
    data, _ = token_stream(tmp_path / "data", n_tokens=816)
    full, before, after = _three_runs(tmp_path, "hf_train.py", data,
                                      ["--accum", "2", "--save-every", "3"], steps=14, die_at=6)
    assert len(full) == 28 and full == by_hand(Loader(TokenWindows(data, seq_len=16), global_batch_size=2, seed=7), 28)
    assert_resumed_exactly(full, before, after, 12)
    state = json.loads((tmp_path / "b" / "checkpoint-6" / "trainer_state.json").read_text())
    saved = state["stateful_callbacks"]["ZerobatchCallback"]["attributes"]
    assert saved["global_step"] == 6 and saved["loader_state"]["consumed"] == 24
    # the run card in the trainer's own checkpoint: zerobatch trace reproduces what each
    # process's model received (6 optimizer steps x accumulation 2 = 12 loader steps)
    from zerobatch.adapters.trace import Trace
    trace = Trace(tmp_path / "b" / "checkpoint-6" / "trainer_state.json")
    assert trace.card["world_sizes"] == [[0, 2]] and trace.position == 12
    for step in range(12):
        rows = [row for part in trace.step(step, metadata=False)["ranks"] for row in part["rows"]]
        assert [list(range(r["item"] * 16, r["item"] * 16 + 16)) for r in rows] == full[step]


@pytest.mark.timeout(600)
def test_trl_sft_on_packed_chat_rows_with_loss_masks_resumes_exactly(tmp_path):
    """TRL's SFTTrainer on packed conversations with their loss masks (PackedDocuments,
    layout='hf'), killed after the checkpoint of step 4 and resumed. The uninterrupted reference
    is the loader iterated by hand (the test above shows a Trainer's uninterrupted run is
    exactly that); SFTTrainer's processes are the slowest to start, so the 2-process case is
    the Trainer's test above (SFTTrainer is a Trainer there)."""
    data = trainerkit.chat_stream(tmp_path / "chat")
    script = [str(HERE / "hf_train.py"), data, str(tmp_path / "b"), "--steps", "8", "--trainer", "trl",
              "--source", "packed", "--accum", "2", "--save-every", "2"]
    run(script + ["--die-at", "4"], record=tmp_path / "kill", expect_killed=True)
    run(script + ["--resume"], record=tmp_path / "res")
    full = by_hand(Loader(PackedDocuments(data, seq_len=16, layout="hf", loss_mask=True), global_batch_size=2, seed=7),
                   16)
    assert_resumed_exactly(full, recorded(tmp_path / "kill"), recorded(tmp_path / "res"), 8)


def by_hand(loader, calls):
    """The input_ids of the first ``calls`` batches of ``loader`` iterated epoch after epoch, as
    a trainer given it by attach() receives them."""
    out = []
    while len(out) < calls:
        for step in loader:
            out.append(hf_batch(step)["input_ids"].tolist())
            if len(out) == calls:
                break
        else:
            loader.set_epoch(loader.epoch + 1)
    return out


@pytest.mark.timeout(600)
def test_accelerate_loop_on_2_processes_killed_resumes_exactly_on_1(tmp_path):
    """accelerate: register_for_checkpointing(loader), save_state / load_state."""
    data, _ = token_stream(tmp_path / "data", n_tokens=816)
    full, before, after = _three_runs(tmp_path, "accelerate_train.py", data, [], steps=16, die_at=6)
    assert_resumed_exactly(full, before, after, 12)


# -- the batches ----------------------------------------------------------------------------

def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=trainerkit.VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    return token_stream(tmp_path_factory.mktemp("hf") / "data", n_tokens=3000)


def test_windows_train_every_target_in_a_hugging_face_model(stream):
    """(x, y) windows: the model's own loss over hf_batch is the cross entropy of every one of
    the window's targets, the last included (shift_labels), as zerobatch's loss is."""
    x, y = next(iter(Loader(TokenWindows(stream[0], seq_len=16), batch_size=4, seed=1)))
    batch = hf_batch((x, y))
    model = tiny_llama()
    with torch.no_grad():
        got = model(**batch).loss
        logits = model(input_ids=x).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
    assert torch.allclose(got, want, atol=1e-5)
    assert (batch["labels"][:, 1:] == y[:, :-1]).all() and (batch["labels"][:, 0] == -100).all()


def test_boundaries_are_what_hugging_faces_flattening_collator_makes(stream):
    """TokenWindows(boundaries=True) through hf_batch(flatten=True) equals
    DataCollatorWithFlattening over the pieces of documents in each row (the pieces found here
    from the documents the dataset was written from, not from the loader's boundaries)."""
    folder, docs = stream
    starts = {int(d[0]) for d in docs}
    loader = Loader(TokenWindows(folder, seq_len=16, boundaries=True), batch_size=4, seed=2)
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True,
                                          return_tensors="pt")
    for step, _ in zip(loader, range(5)):
        got = hf_batch(step, flatten=True, seq_idx=True)
        pieces = []
        for row in step["input_ids"].tolist():
            cuts = [i for i, t in enumerate(row) if t in starts and i > 0]
            pieces += [row[a:b] for a, b in zip([0, *cuts], [*cuts, len(row)])]
        want = collator([{"input_ids": p} for p in pieces])
        for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k"):
            assert torch.equal(got[key].to(want[key].dtype), want[key]), key
        assert got["max_length_q"] == want["max_length_q"] and got["max_length_k"] == want["max_length_k"]
        lengths = [len(p) for p in pieces]
        assert got["seq_idx"].tolist() == [np.repeat(np.arange(len(pieces)), lengths).tolist()]
        assert got["seq_idx"].dtype == torch.int32


def test_seq_idx_per_row_restarts_at_each_row(stream):
    step = next(iter(Loader(TokenWindows(stream[0], seq_len=16, boundaries=True), batch_size=3, seed=5)))
    got = hf_batch(step, seq_idx=True)
    assert got["seq_idx"].shape == step["input_ids"].shape
    assert (got["seq_idx"][:, 0] == 0).all()
    assert torch.equal(got["seq_idx"].long(), (step["position_ids"] == 0).cumsum(-1) - 1)
    with pytest.raises(ConfigError) as e:
        hf_batch(next(iter(Loader(TokenWindows(stream[0], seq_len=16), batch_size=2))), seq_idx=True)
    assert e.value.field == "seq_idx"


def test_trainer_data_columns_are_the_batches_keys(stream):
    for source, flatten in [(TokenWindows(stream[0], seq_len=8), False),
                            (TokenWindows(stream[0], seq_len=8, boundaries=True), True)]:
        data = TrainerData(Loader(source, batch_size=2), flatten=flatten, seq_idx=source.boundaries)
        assert sorted(data.column_names) == sorted(next(iter(data)))
        before = data.state_dict()
        row = next(iter(data.as_dataset()))            # looking does not move the position
        assert set(row) <= set(data.column_names) and data.state_dict() == before


def _trainer(tmp_path, **kw):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], **kw)
    return Trainer(model=tiny_llama(), args=args)


def test_attach_refuses_what_it_cannot_resume(stream, tmp_path):
    loader = Loader(TokenWindows(stream[0], seq_len=8), batch_size=2)
    with pytest.raises(ConfigError) as e:
        attach(object(), loader)
    assert e.value.field == "trainer"
    with pytest.raises(ConfigError) as e:
        attach(_trainer(tmp_path), object())
    assert e.value.field == "loader"
    endless = Loader(Mixture([(TokenWindows(stream[0], seq_len=8), 1.0)]), batch_size=2)
    with pytest.raises(ConfigError) as e:
        attach(_trainer(tmp_path), endless)
    assert e.value.field == "max_steps"
    # epochs become max_steps: 2 epochs of len(loader) micro-batches, 3 per optimizer step
    trainer = attach(_trainer(tmp_path, num_train_epochs=2, gradient_accumulation_steps=3), loader)
    assert trainer.args.max_steps == -(-2 * len(loader) // 3) and trainer.args.ignore_data_skip


def test_a_checkpoint_without_the_loader_state_is_refused(stream, tmp_path):
    """Resuming from a checkpoint a Trainer saved without attach: no silent restart at the
    beginning of the stream."""
    trainer = attach(_trainer(tmp_path, max_steps=2), Loader(TokenWindows(stream[0], seq_len=8), batch_size=2))
    state = type(trainer.state)()
    state.global_step = 5
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, ZerobatchCallback))
    with pytest.raises(StateError) as e:
        cb.on_train_begin(trainer.args, state, trainer.control, train_dataloader=trainer.get_train_dataloader())
    assert e.value.field == "stateful_callbacks"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "trainer_state.json").write_text('{"stateful_callbacks": {"ZerobatchCallback": {"attributes": 3}}}')
    with pytest.raises(StateError) as e:
        trainer.train(resume_from_checkpoint=str(bad))
    assert e.value.field == "stateful_callbacks"


def test_the_module_imports_transformers_only_itself():
    code = ("import sys, zerobatch.adapters.torch, zerobatch.adapters.sources; "
            "assert 'transformers' not in sys.modules and 'accelerate' not in sys.modules")
    import subprocess
    subprocess.run([sys.executable, "-c", code], check=True)


def _in_process_run(tmp_path, name, make_loader, steps, resume=False, **kw):
    """A Trainer run in this process on a fresh loader; the input_ids of every training call."""
    seen = []
    model = tiny_llama().train()
    model.register_forward_pre_hook(lambda m, a, k: seen.append(k["input_ids"].tolist()) if m.training else None,
                                    with_kwargs=True)
    args = TrainingArguments(output_dir=str(tmp_path / name), use_cpu=True, report_to=[], max_steps=steps,
                             save_steps=2, learning_rate=1e-3, disable_tqdm=True, **kw)
    trainer = attach(Trainer(model=model, args=args), make_loader())
    trainer.train(resume_from_checkpoint=True if resume else None)
    return seen


@pytest.mark.parametrize("kind", ["documents", "mixture"])
def test_documents_and_mixtures_resume_exactly_in_the_trainer(stream, tmp_path, kind):
    """Whole documents (padded rows with an attention mask) and a weighted mixture of two
    datasets, in the Trainer: 6 steps uninterrupted equal 4 steps, then a new Trainer resumed
    from checkpoint-4 for 2 more (in this process: the subprocess tests above kill)."""
    other, _ = token_stream(tmp_path / "other", n_tokens=2000, seed=9, offset=5000)

    def make():
        if kind == "documents":
            return Loader(TokenDocuments(stream[0], width=17), batch_size=3, seed=4)
        return Loader(Mixture([(TokenWindows(stream[0], seq_len=16), 0.7), (TokenWindows(other, seq_len=16), 0.3)],
                              seed=4), batch_size=3)

    full = _in_process_run(tmp_path, "full", make, 6, gradient_accumulation_steps=2)
    head = _in_process_run(tmp_path, "part", make, 4, gradient_accumulation_steps=2)
    tail = _in_process_run(tmp_path, "part", make, 6, resume=True, gradient_accumulation_steps=2)
    assert len(full) == 12 and head == full[:8] and tail == full[8:]
    if kind == "mixture":
        assert {row[0] >= 5000 for call in full for row in call} == {True, False}


# -- found in review: int32 loaders, flattened rows, a loader started ahead ------------------------

def test_an_int32_loader_trains_as_an_int64_one(stream):
    """A loader of dtype int32 (half the memory per batch): labels reach the loss as int64 (Hugging
    Face's cross entropy refuses int32 targets), and the loss is the int64 loader's."""
    model = tiny_llama()
    for source, flatten in [(TokenWindows(stream[0], seq_len=16), False),
                            (TokenWindows(stream[0], seq_len=16, boundaries=True), True),
                            (TokenDocuments(stream[0], width=17), False)]:
        losses = []
        for dtype in (torch.int64, torch.int32):
            step = next(iter(Loader(source, batch_size=3, seed=2, dtype=dtype)))
            batch = hf_batch(step, flatten=flatten)
            assert all(batch[k].dtype == torch.int64 for k in ("labels", "shift_labels") if k in batch)
            with torch.no_grad():
                losses.append(model(**batch).loss)
        assert torch.isfinite(losses[0]) and torch.equal(losses[0], losses[1])


def test_flattened_rows_do_not_attend_to_one_another(stream):
    """flatten=True on windows and padded documents (no boundaries of their own): position_ids
    restart at each row, so a row flattened into one with the others gets, token for token, the
    logits it gets alone (sdpa and eager; the Trainer's use_cache=False, as TrainingArguments sets it)."""
    torch.manual_seed(0)
    for impl in ("sdpa", "eager"):
        config = LlamaConfig(vocab_size=trainerkit.VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                             use_cache=False, attn_implementation=impl)
        model = LlamaForCausalLM(config).eval()
        for source in (TokenWindows(stream[0], seq_len=8), TokenDocuments(stream[0], width=12)):
            data = TrainerData(Loader(source, batch_size=3, seed=1), flatten=True)
            batch = next(iter(data))
            assert sorted(batch) == sorted(data.column_names) and "attention_mask" not in batch
            step = next(iter(Loader(source, batch_size=3, seed=1)))
            rows = step[0] if isinstance(step, (tuple, list)) else step["input_ids"]
            width = rows.shape[1]
            with torch.no_grad():
                flat = model(**batch).logits[0]
                for r in range(len(rows)):
                    n = width if isinstance(step, (tuple, list)) else int(step["attention_mask"][r].sum())
                    alone = model(input_ids=rows[r:r + 1, :n]).logits[0]
                    assert torch.allclose(flat[r * width:r * width + n], alone, atol=1e-5), (impl, r)


def test_a_loader_started_ahead_pickles_and_continues(stream):
    """start_prefetch (attach calls it on resume) leaves the loader picklable (spawned DataLoader
    workers, deepcopy): the pass started ahead is not copied; both copies continue at the state."""
    import copy
    import pickle

    def make():
        return Loader(TokenWindows(stream[0], seq_len=16), batch_size=4, seed=1, num_threads=1)

    want = [x.tolist() for x, _ in make()]
    loader = make()
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    del it
    loader = make()
    loader.load_state_dict(state)
    loader.start_prefetch()
    for other in (pickle.loads(pickle.dumps(loader)), copy.deepcopy(loader)):
        assert other.state_dict() == state and [x.tolist() for x, _ in other] == want[3:]
    assert loader.state_dict() == state and [x.tolist() for x, _ in loader] == want[3:]

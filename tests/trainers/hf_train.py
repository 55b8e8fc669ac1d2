"""A Hugging Face Trainer (or TRL SFTTrainer) run on a zerobatch dataset, for the kill-and-resume
tests: a tiny Llama on the CPU whose forward calls are recorded (trainerkit.record_inputs)."""

from __future__ import annotations

import argparse
import os

import torch
import trainerkit
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from zerobatch.adapters.hf import TrainerData, attach
from zerobatch.adapters.torch import Loader, PackedDocuments, TokenWindows

p = argparse.ArgumentParser()
p.add_argument("data")
p.add_argument("out")
p.add_argument("--steps", type=int, required=True)
p.add_argument("--global-batch", type=int, default=4)
p.add_argument("--accum", type=int, default=1)
p.add_argument("--seq-len", type=int, default=16)
p.add_argument("--save-every", type=int, default=3)
p.add_argument("--die-at", type=int)
p.add_argument("--resume", action="store_true")
p.add_argument("--source", choices=["windows", "boundaries", "packed"], default="windows")
p.add_argument("--trainer", choices=["hf", "trl"], default="hf")
a = p.parse_args()

world = int(os.environ.get("WORLD_SIZE", "1"))
common = dict(output_dir=a.out, max_steps=a.steps, save_steps=a.save_every, save_strategy="steps",
              gradient_accumulation_steps=a.accum, per_device_train_batch_size=a.global_batch // world // a.accum,
              learning_rate=1e-3, logging_steps=100, report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
              ddp_backend="gloo" if world > 1 else None, save_only_model=False, disable_tqdm=True)
if a.trainer == "trl":
    from trl import SFTConfig, SFTTrainer
    args = SFTConfig(**common, packing=False, dataset_kwargs={"skip_prepare_dataset": True})
else:
    args = TrainingArguments(**common)

torch.manual_seed(0)
config = LlamaConfig(vocab_size=trainerkit.VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
model = trainerkit.record_inputs(LlamaForCausalLM(config))

if a.source == "windows":
    source = TokenWindows(a.data, seq_len=a.seq_len)
elif a.source == "boundaries":
    source = TokenWindows(a.data, seq_len=a.seq_len, boundaries=True)
else:
    source = PackedDocuments(a.data, seq_len=a.seq_len, layout="hf", loss_mask=True)
# the micro-batch: the global batch over processes and accumulation steps
loader = Loader(source, global_batch_size=a.global_batch // a.accum, seed=7)


class Die(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        if a.die_at is not None and state.global_step == a.die_at:
            if torch.distributed.is_initialized():
                torch.distributed.barrier()         # every rank is past the checkpoint
            trainerkit.die()


if a.trainer == "trl":
    # SFTTrainer wants a dataset and a tokenizer: the loader's batches, already tokenized,
    # packed and masked (skip_prepare_dataset), and a tokenizer it only asks for its pad id
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1}, "<unk>")),
                                  pad_token="<pad>", unk_token="<unk>")
    data = TrainerData(loader)
    trainer = SFTTrainer(model=model, args=args, train_dataset=data.as_dataset(), processing_class=tok, callbacks=[Die()])
    attach(trainer, data)
else:
    trainer = Trainer(model=model, args=args, callbacks=[Die()])
    attach(trainer, loader)
trainer.train(resume_from_checkpoint=True if a.resume else None)

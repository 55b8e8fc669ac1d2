"""OLMo-core's own Trainer (BasicTrainModule, its CheckpointerCallback) on a zerobatch TOKSTREAM dataset
read through TokenStreamDocumentSource and OLMo-core's ComposableDataLoader, for the kill-and-resume
tests: the model records the input_ids of every forward call (trainerkit)."""

from __future__ import annotations

import argparse
import os

import torch
import trainerkit
from olmo_core.data.collator import DataCollator
from olmo_core.data.composable import ComposableDataLoader, ConcatAndChunkInstanceSource
from olmo_core.data.tokenizer import TokenizerConfig
from olmo_core.train import Duration, TrainerConfig, prepare_training_environment, teardown_training_environment
from olmo_core.train.callbacks import Callback, CheckpointerCallback
from olmo_core.train.train_module.train_module import BasicTrainModule

from zerobatch.adapters.olmo import TokenStreamDocumentSource

p = argparse.ArgumentParser()
p.add_argument("data")
p.add_argument("out")
p.add_argument("--steps", type=int, required=True)
p.add_argument("--save-every", type=int, default=2)
p.add_argument("--die-at", type=int)
p.add_argument("--seq-len", type=int, default=16)
p.add_argument("--global-batch", type=int, default=8, help="instances per step over all ranks")
p.add_argument("--micro", type=int, default=2, help="instances per micro-batch per rank")
a = p.parse_args()


class LM(trainerkit.RecordingLM):
    dry_run = False

    def forward(self, input_ids, labels=None, **kwargs):
        if not self.dry_run:            # (OLMo-core's start-up dry run trains on a mock batch)
            self.record(input_ids)
        return self.head(self.embed(input_ids))


class Module(BasicTrainModule):
    """OLMo-core's example TrainModule, without FLOP accounting (a model it does not know)."""

    def train_batch(self, batch, dry_run=False):
        self.model.dry_run = dry_run
        return super().train_batch(batch, dry_run=dry_run)

    def num_flops_per_token(self, seq_len):
        return None

    def global_num_flops_in_batch(self, batch):
        return None


class Die(Callback):
    def post_checkpoint_saved(self, path):
        if self.step == a.die_at:
            trainerkit.die()


if __name__ == "__main__":
    prepare_training_environment(seed=0, backend="cpu:gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None)
    from olmo_core.distributed.utils import get_rank, get_world_size
    tok = TokenizerConfig(vocab_size=trainerkit.VOCAB, eos_token_id=0, pad_token_id=0)
    work = os.path.join(a.out, "work")
    docs = TokenStreamDocumentSource(a.data, tokenizer=tok, work_dir=work)
    instances = ConcatAndChunkInstanceSource(docs, sequence_length=a.seq_len, work_dir=work)
    data_loader = ComposableDataLoader(instances, collator=DataCollator(pad_token_id=0), tokenizer=tok, work_dir=work,
                                       global_batch_size=a.global_batch * a.seq_len, seed=7,
                                       dp_world_size=get_world_size(), dp_rank=get_rank(),
                                       display_source_visualization=False)
    torch.manual_seed(0)
    model = LM()
    module = Module(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                              rank_microbatch_size=a.micro * a.seq_len)
    trainer = TrainerConfig(save_folder=os.path.join(a.out, "ckpt"), work_dir=work, device="cpu",
                            max_duration=Duration.steps(a.steps), metrics_collect_interval=1,
                            cancel_check_interval=1000, save_overwrite=True,
                            callbacks={"checkpointer": CheckpointerCallback(save_interval=a.save_every,
                                                                            save_async=False),
                                       "die": Die()}).build(module, data_loader)
    trainer.maybe_load_checkpoint(trainer.save_folder)
    trainer.fit()
    teardown_training_environment()

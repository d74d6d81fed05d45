"""transformers' ``Trainer`` on 2 CPU processes under torchrun, no ddpdoctor in it.

The ``Trainer`` builds the ``DistributedDataParallel`` (through Accelerate), with
``find_unused_parameters=True`` unless told otherwise, and a BERT model broadcasts its constant
``position_ids`` and ``token_type_ids`` buffers at every forward: ddpdoctor names both, with the
``TrainingArguments`` switch that turns each off. A tiny BERT built from its config: nothing is
downloaded.

    ddpdoctor run --run-dir runs/transformers -- torchrun --nproc-per-node 2 --master-port PORT \\
        examples/zero_code/transformers_train.py --steps 8
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

TOKENS = 16


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """Random token ids, labelled by the first one."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 100, (n, TOKENS), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        return {
            "input_ids": ids,
            "attention_mask": torch.ones(TOKENS, dtype=torch.long),
            "labels": (ids[0] > 50).long(),
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps (no_sync between)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=TOKENS,
    )
    model = BertForSequenceClassification(config)
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=args.accumulation,
            max_steps=args.steps,
            use_cpu=True,
            ddp_backend="gloo",
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            seed=0,
            dataloader_num_workers=0,
        )
        result = Trainer(model=model, args=training, train_dataset=Tokens(256)).train()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
    print(f"rank {os.environ.get('RANK', '0')} loss {result.training_loss!r} parameters {digest}", flush=True)


if __name__ == "__main__":
    main()

"""transformers' ``Trainer`` on 2 CPU processes with ddpdoctor's callback: its figures in TensorBoard.

    torchrun --nproc-per-node 2 examples/integrations/transformers_train.py --logging-dir tb --straggle-ms 40
    tensorboard --logdir tb

A tiny BERT built from its config (nothing is downloaded). ``--straggle-ms`` plants a straggler:
the last rank starts each step that much later, as a slow data loader on one host would make it.
``--report-to wandb`` logs to Weights & Biases instead (offline with ``WANDB_MODE=offline``).
Under ``ddpdoctor run`` the callback uses the monitor ``ddpdoctor run`` attached.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from ddpdoctor.integrations.transformers import DDPDoctorCallback

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
        mask = torch.ones(TOKENS, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": mask, "labels": (ids[0] > 50).long()}


class LateStart(TrainerCallback):  # type: ignore[misc]
    """The last rank starts every step ``seconds`` late (a straggler, planted)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if self.seconds and args.process_index == args.world_size - 1:
            time.sleep(self.seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--report-to", default="tensorboard")
    parser.add_argument("--logging-dir", default="tb")
    parser.add_argument("--run-dir", help="ddpdoctor's run dir (default: ddpdoctor's own choice)")
    parser.add_argument("--straggle-ms", type=float, default=0.0, help="the last rank starts each step this much late")
    parser.add_argument("--every", type=int, default=10, help="log ddpdoctor's figures every this many steps")
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
    options = {"run_dir": args.run_dir} if args.run_dir else {}
    # where TensorBoard's events go: an argument up to transformers 4, an environment variable since 5
    os.environ["TENSORBOARD_LOGGING_DIR"] = args.logging_dir
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    logging_dir = {"logging_dir": args.logging_dir} if "logging_dir" in fields else {}
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out,
            **logging_dir,
            logging_steps=args.every,
            per_device_train_batch_size=8,
            max_steps=args.steps,
            use_cpu=True,
            ddp_backend="gloo",
            save_strategy="no",
            report_to=[args.report_to],
            disable_tqdm=True,
            seed=0,
            dataloader_num_workers=0,
        )
        callbacks = [DDPDoctorCallback(every_n_steps=args.every, **options), LateStart(args.straggle_ms / 1000.0)]
        Trainer(model=model, args=training, train_dataset=Tokens(1024), callbacks=callbacks).train()
    if os.environ.get("RANK", "0") == "0":
        print("transformers training done", flush=True)


if __name__ == "__main__":
    main()

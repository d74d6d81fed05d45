"""Lightning on 2 CPU processes (strategy="ddp") with ddpdoctor's callback: its figures in TensorBoard.

    python examples/integrations/lightning_train.py --logger tensorboard --save-dir tb --straggle-ms 40
    tensorboard --logdir tb

The model is the demo's (``ddpdoctor demo``): a small convnet with BatchNorm buffers and several
gradient buckets. ``--straggle-ms`` plants a straggler as the demo does: the last rank's backward
is that much slower. ``--logger wandb`` logs to Weights & Biases instead (offline with
``WANDB_MODE=offline``), ``csv`` to a CSV file, ``tensorboard,csv`` to both. Run it under
``ddpdoctor run`` too: the callback then uses the monitor ``ddpdoctor run`` attached.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpdoctor.cli.demo_training import DemoNet
from ddpdoctor.integrations.lightning import DDPDoctorCallback


class Classifier(L.LightningModule):
    def __init__(self, straggle_s: float) -> None:
        super().__init__()
        self.net = DemoNet()
        self.straggle_s = straggle_s

    def setup(self, stage: str) -> None:
        # the last rank's backward is slower (the rank is known once the strategy set up the processes)
        if self.trainer.global_rank == self.trainer.world_size - 1:
            self.net.backward_delay = self.straggle_s

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def make_logger(kind: str, save_dir: str) -> Any:
    if kind == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        return TensorBoardLogger(save_dir, name="lightning")
    if kind == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        return WandbLogger(project="ddpdoctor-example", save_dir=save_dir)
    if kind == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir, name="lightning-csv")
    raise SystemExit(f"unknown logger {kind!r} (tensorboard, wandb, csv)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument(
        "--logger", default="tensorboard", help="tensorboard, wandb or csv, or several: tensorboard,csv"
    )
    parser.add_argument("--save-dir", default="lightning-logs")
    parser.add_argument("--run-dir", help="ddpdoctor's run dir (default: ddpdoctor's own choice)")
    parser.add_argument("--straggle-ms", type=float, default=0.0, help="the last rank's backward is this much slower")
    parser.add_argument("--every", type=int, default=10, help="log ddpdoctor's figures every this many steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(2048, 3, 16, 16, generator=gen), torch.randint(0, 10, (2048,), generator=gen))
    options = {"run_dir": args.run_dir} if args.run_dir else {}
    trainer = L.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=args.devices,
        max_steps=args.steps,
        logger=[make_logger(kind, args.save_dir) for kind in args.logger.split(",")],
        log_every_n_steps=args.every,
        callbacks=[DDPDoctorCallback(every_n_steps=args.every, **options)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Classifier(args.straggle_ms / 1000.0), DataLoader(data, batch_size=32))
    if trainer.global_rank == 0:
        print("lightning training done", flush=True)


if __name__ == "__main__":
    main()

"""PyTorch Lightning on 2 CPU processes (strategy="ddp"), no ddpdoctor in it.

Lightning builds the ``DistributedDataParallel`` inside its strategy; ``ddpdoctor run``
instruments it all the same.

    ddpdoctor run --run-dir runs/lightning -- python examples/zero_code/lightning_train.py
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--accelerator", default="cpu", help="gpu: one process per GPU, NCCL")
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(512, 16, generator=gen), torch.randn(512, 1, generator=gen))
    trainer = L.Trainer(
        accelerator=args.accelerator,
        strategy="ddp",
        devices=args.devices,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), DataLoader(data, batch_size=16))
    if trainer.global_rank == 0:
        print("lightning training done", flush=True)


if __name__ == "__main__":
    main()

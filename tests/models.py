"""Small real models for the tests (no torchvision here)."""

from __future__ import annotations

import time

import torch
from torch import nn


class SmallNet(nn.Module):
    """An MLP with BatchNorm (buffers to broadcast) and enough layers for several buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(32, 64),
            nn.BatchNorm1d(64),
            nn.ReLU(),
            nn.Linear(64, 64),
            nn.ReLU(),
            nn.Linear(64, 64),
            nn.ReLU(),
        )
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_model(seed: int = 0) -> SmallNet:
    torch.manual_seed(seed)
    return SmallNet()


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds  # type: ignore[attr-defined]  # autograd's ctx carries it to backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)  # type: ignore[attr-defined]  # set by forward
        return grad, None


class DelayNet(SmallNet):
    """SmallNet whose forward and backward take at least the given extra seconds."""

    def __init__(self, forward_s: float = 0.0, backward_s: float = 0.0) -> None:
        super().__init__()
        self.forward_s = forward_s
        self.backward_s = backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.forward_s:
            time.sleep(self.forward_s)
        h = self.body(x)
        if self.backward_s:
            h = _SlowBackward.apply(h, self.backward_s)  # backward crosses this before body's grads
        return self.head(h)


def batches(rank: int, steps: int, seed: int = 100) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed + rank)
    return [(torch.randn(16, 32, generator=gen), torch.randn(16, 4, generator=gen)) for _ in range(steps)]

"""Rank functions for ``test_ddp_divisor`` (and its GPU test in ``test_cuda``): DDP's own scaling
at a world size of 3, where a divide and a multiply by the reciprocal give other bits, with and
without ddpdoctor attached."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor
from ddpdoctor.runtime.step import native_hook

BUCKET_CAP_MB = 0.004  # ~4 KB: the net's gradients fall into several buckets of several tensors
STEPS = 5


class Net(torch.nn.Module):
    """An MLP with a branch that the odd steps leave out (``skip``), and a sparse embedding in front."""

    def __init__(self, sparse: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 16, sparse=True) if sparse else None
        self.body = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh()
        )
        self.branch = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 4)
        self.to(dtype)

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x).mean(1)
        h = self.body(x)
        if not skip:
            h = h + self.branch(h)
        return self.head(h)  # type: ignore[no-any-return]


def _batches(
    rank: int, n: int, sparse: bool, dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(n):
        x = torch.randint(0, 50, (8, 3), generator=g) if sparse else torch.randn(8, 16, generator=g).to(dtype)
        yield x.to(device), torch.randn(8, 4, generator=g).to(dtype).to(device)


def train(ddp: DDP, rank: int, case: dict[str, Any]) -> list[float]:
    """``STEPS`` steps of SGD as ``case`` says; the final parameters and gradients, flattened."""
    sparse, dtype = case.get("sparse", False), case.get("dtype", torch.float32)
    device = next(ddp.parameters()).device
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    join = case.get("join")
    # under Join the ranks train 5, 4 and 2 steps: DDP's divisor goes 3, 2, 1 with
    # divide_by_initial_world_size=False
    n = (STEPS, STEPS - 1, STEPS - 3)[rank] if join is not None else STEPS
    ctx = Join([ddp], **join) if join is not None else contextlib.nullcontext()
    with ctx:
        for step, (x, y) in enumerate(_batches(rank, n, sparse, dtype, device)):
            if case.get("script_grads"):  # .grad set by the script: new tensors, not the bucket's views
                for p in ddp.parameters():
                    p.grad = torch.zeros_like(p)
            else:
                opt.zero_grad(set_to_none=case.get("set_to_none", False))
            if case.get("branch_grads"):  # the script's own nonzero .grad on every branch parameter
                for q in ddp.module.branch.parameters():
                    q.grad = q.detach() * 7
            if case.get("drop_one"):  # one gradient of a bucket starts from None, its neighbours kept
                ddp.module.body[2].bias.grad = None
            if case.get("accumulate") and step % 2:
                with ddp.no_sync():
                    ((ddp(x) - y) ** 2).mean().backward()
            skip = bool(case.get("skip")) and step % 2 == 1
            ((ddp(x, skip=skip) - y) ** 2).mean().mul(case.get("loss_scale", 1.0)).backward()
            opt.step()
    # the last step's gradients too, where a gradient's bits may not reach the parameters (the
    # subnormal cases); in float64, which holds every float32 and bfloat16 value exactly
    params = [p.detach().double().flatten() for p in ddp.module.parameters()]
    grads = [g.to_dense() if g.is_sparse else g for g in (p.grad for p in ddp.module.parameters()) if g is not None]
    grads = [g.detach().double().flatten() for g in grads]
    return torch.cat(params + grads).tolist()


CASES: dict[str, dict[str, Any]] = {
    # gradient_as_bucket_view with gradients kept between steps: DDP divides them in place
    "kept": {"set_to_none": False},
    "none": {"set_to_none": True},
    "mixed": {"drop_one": True},
    "script_grads": {"script_grads": True},
    "no_sync": {"accumulate": True},
    "unused": {"skip": True, "ddp": {"find_unused_parameters": True}},
    # the odd steps leave the branch out; its .grad is the script's own tensor (not the bucket's
    # view), which DDP copies into the bucket (and multiplies) though no backward accumulated it
    "unused_script_grads": {"skip": True, "branch_grads": True, "ddp": {"find_unused_parameters": True}},
    "static_graph": {"ddp": {"static_graph": True}},
    "bfloat16": {"dtype": torch.bfloat16},
    "float64": {"dtype": torch.float64},
    # gradients of float32's subnormal range (below 1.2e-38), where a product loses bits: the
    # extension multiplies small buckets itself, and must round each product as torch's kernel does
    "subnormal": {"loss_scale": 1e-39},
    "subnormal_copied": {"loss_scale": 1e-39, "gab": False},
    # divide_by_initial_world_size=False: DDP divides by the ranks still training
    "join": {"join": {"divide_by_initial_world_size": False}},
    "join_copied": {"join": {"divide_by_initial_world_size": False}, "gab": False, "set_to_none": True},
    # sparse gradients: DDP divides them (gradient_as_bucket_view does not apply)
    "sparse": {"sparse": True, "gab": False},
}
#: The cases the Python route (the extension loaded, a route the native hook does not take) runs too.
PYTHON_ROUTE = ("kept", "mixed", "unused_script_grads", "join", "sparse")
#: The cases of the GPU test (gloo over CUDA tensors; the buckets take the Python route there).
CUDA_CASES = ("kept", "mixed", "script_grads", "no_sync", "unused", "unused_script_grads", "static_graph", "join")


def _ddp(case: dict[str, Any], device: torch.device) -> DDP:
    model = Net(sparse=case.get("sparse", False), dtype=case.get("dtype", torch.float32)).to(device)
    options = {"gradient_as_bucket_view": case.get("gab", True), "bucket_cap_mb": BUCKET_CAP_MB, **case.get("ddp", {})}
    if device.type == "cuda":
        options["device_ids"] = [device.index]
    return DDP(model, **options)


def _instrumented(
    root: Path, name: str, rank: int, case: dict[str, Any], device: torch.device
) -> tuple[list[float], list[str]]:
    ddp = _ddp(case, device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ddpdoctor.instrument(ddp, run_dir=root / name):
            params = train(ddp, rank, case)
    return params, [str(w.message) for w in caught if issubclass(w.category, ddpdoctor.CommHookWarning)]


@contextlib.contextmanager
def _python_route(extension: bool) -> Iterator[None]:
    """The Python comm hook times the buckets (as on a GPU, or after a user's hook); with
    ``extension`` False, without the native extension's scale either."""
    saved: tuple[Callable[..., Any], Callable[..., Any]] = (native_hook.choose, native_hook.python_route_scale)
    native_hook.choose = lambda cuda: None  # type: ignore[assignment]
    if not extension:
        native_hook.python_route_scale = lambda ddp, cuda: None  # type: ignore[assignment]
    try:
        yield
    finally:
        native_hook.choose, native_hook.python_route_scale = saved  # type: ignore[assignment]


def divisor_runs(rank: int, world_size: int, tmp: str, device: str = "cpu") -> dict[str, Any]:
    """Each case trained plain and instrumented, on the native route and on the Python route
    (on a GPU, where the buckets always take the Python route: its cases, under "native")."""
    root = Path(tmp)
    dev = torch.device("cpu")
    if device == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    out: dict[str, Any] = {"rank": rank, "native": {}, "python": {}}
    for name, case in CASES.items():
        if dev.type == "cuda" and name not in CUDA_CASES:
            continue
        plain = train(_ddp(case, dev), rank, case)
        out["native"][name] = (plain, *_instrumented(root, name, rank, case, dev))
        if name in PYTHON_ROUTE and dev.type == "cpu":
            with _python_route(extension=True):
                out["python"][name] = (plain, *_instrumented(root, f"py-{name}", rank, case, dev))
    with _python_route(extension=False):
        out["bare"] = {name: _instrumented(root, f"bare-{name}", rank, CASES[name], dev) for name in ("kept", "join")}
    return out

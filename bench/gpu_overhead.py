"""Step-time overhead of ddpdoctor on one GPU (NCCL, world size 1), side by side with plain DDP.

Two models built here (no torchvision):

* ``transformer``: a 12-layer ``nn.TransformerEncoder`` (d_model 1024, 16 heads, FFN 4096,
  ~150 M parameters), batch 16 x 512 tokens, TF32 matmuls: the GPU sets the step's time;
* ``small``: a 24-layer MLP of width 256, batch 64, 1 MB buckets: the launches set it (a
  launch-bound job, where every microsecond of host work on the training thread shows).

How the figures are taken. One process, one NCCL group of world size 1 (DDP all-reduces every
bucket all the same). Three DDPs of the same model live side by side on the GPU, built once from
the same seed: plain, instrumented (``ddpdoctor.instrument`` with default options and a temporary
run dir) and a second plain one. Each first runs ``--warmup`` steps, past the dense start of the
sampled checks (steps 0, 1, 3, 7, 15, 31; later ones, every 50 steps, land in the timed rounds as
in a real run). A round then times N steps of one DDP on the host between two
``torch.cuda.synchronize()`` (the bench's own waits, outside the steps) and gives the mean step
time. Rounds come in pairs, instrumented next to plain in alternating order, and a "plain vs
plain" row measures the noise the same way. Overhead = median over pairs of (round / its partner
- 1). At the end the monitor must have timed every step with CUDA events and kept every probe
on. ``own`` is ddpdoctor's own host time per step on the training thread (``Monitor.own_ns``).

Usage: ``python bench/gpu_overhead.py [--pairs 5] [--steps 20] [--model transformer|small] [--json FILE]``
(``--device cpu`` runs the same on gloo, to check the bench itself where there is no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ddpdoctor
from bench.harness import free_port, pair_roles, paired_overheads, pct


class MLP(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Encoder(nn.Module):
    def __init__(self, d_model: int, layers: int) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, 16, 4 * d_model, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def workload(name: str, device: torch.device, quick: bool) -> tuple[nn.Module, torch.Tensor, float]:
    """The model, its input and DDP's bucket cap in MB."""
    torch.manual_seed(0)
    if name == "transformer":
        d, layers, batch, seq = (256, 2, 4, 64) if quick or device.type == "cpu" else (1024, 12, 16, 512)
        return Encoder(d, layers).to(device), torch.randn(batch, seq, d, device=device), 25.0
    width = 256
    return MLP(width, 24).to(device), torch.randn(64, width, device=device), 1.0


class Contender:
    """One DDP of the workload (plain or instrumented), built once and stepped round after round."""

    def __init__(self, name: str, instrumented: bool, device: torch.device, quick: bool) -> None:
        self.model, self.x, cap = workload(name, device, quick)
        ids = [device.index] if device.type == "cuda" else None
        self.ddp = DDP(self.model, device_ids=ids, bucket_cap_mb=cap)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=1e-4)
        self.tmp = tempfile.mkdtemp(prefix="ddpdoctor-gpu-bench-")
        self.monitor = ddpdoctor.instrument(self.ddp, run_dir=self.tmp) if instrumented else None
        self.device = device
        self.steps = 0

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> None:
        loss = self.ddp(self.x).float().square().mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.steps += 1

    def round(self, steps: int) -> dict[str, float]:
        """Mean step time of ``steps`` steps (ms), the process's CPU time per step (ms, every
        thread), and ddpdoctor's own host µs per step."""
        self.sync()
        own0 = self.monitor.own_ns if self.monitor is not None else 0
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.sync()
        elapsed = time.perf_counter() - t0
        result = {"step_ms": elapsed * 1000.0 / steps, "cpu_ms": (time.process_time() - cpu0) * 1000.0 / steps}
        if self.monitor is not None:
            result["own_us"] = (self.monitor.own_ns - own0) / 1000.0 / steps
        return result

    def close(self) -> None:
        """Check that the monitor timed every step with the device's clock and kept every probe on."""
        if self.monitor is None:
            return
        probes = dict(self.monitor.probes.on)
        self.monitor.close()
        log = ddpdoctor.load_run(self.tmp).ranks[0]
        want = "cuda" if self.device.type == "cuda" else "host"
        if log.header is None or log.header.clock != want or log.steps_total < self.steps:
            clock = log.header.clock if log.header else None
            raise RuntimeError(f"ddpdoctor recorded {log.steps_total} of {self.steps} steps, clock {clock}")
        if not all(probes.values()):
            raise RuntimeError(f"a probe was switched off: {probes}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=9, help="interleaved pairs per row and model (default 5)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round (default 20)")
    parser.add_argument("--warmup", type=int, default=40, help="warm-up steps per model (default 40)")
    parser.add_argument("--model", choices=["transformer", "small"], default=None, help="time one model only")
    parser.add_argument("--device", default="cuda", help="cuda (NCCL) or cpu (gloo, a check of the bench)")
    parser.add_argument("--quick", action="store_true", help="a small transformer (a check of the bench)")
    parser.add_argument("--json", default=None, help="write the per-round results here")
    args = parser.parse_args()

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {what}; torch {torch.__version__}; NCCL world size 1" if device.type == "cuda" else "device: CPU")
    models = [args.model] if args.model else ["transformer", "small"]
    rounds: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for name in models:
        contenders = {
            "plain": Contender(name, False, device, args.quick),
            "instrumented": Contender(name, True, device, args.quick),
            "plain-b": Contender(name, False, device, args.quick),
        }
        for c in contenders.values():  # past the dense start of the sampled checks (steps 0-31)
            for _ in range(args.warmup):
                c.step()
        rows: dict[str, list[dict[str, float]]] = {"plain": [], "instrumented": [], "plain-b": [], "plain-n": []}
        for pair in range(args.pairs):
            for k, (tool, base) in enumerate((("instrumented", "plain"), ("plain-b", "plain-n"))):
                for role in pair_roles(pair, k):
                    mode = tool if role == "tool" else base
                    rows[mode].append(contenders["plain" if mode == "plain-n" else mode].round(args.steps))
        for c in contenders.values():
            c.close()
        del contenders
        rounds[name] = rows
        plain = [r["step_ms"] for r in rows["plain"]]
        instrumented = [r["step_ms"] for r in rows["instrumented"]]
        noise = paired_overheads([r["step_ms"] for r in rows["plain-n"]], [r["step_ms"] for r in rows["plain-b"]])
        over = paired_overheads(plain, instrumented)
        own = statistics.median(r["own_us"] for r in rows["instrumented"])
        print(
            f"{name:12s} plain {statistics.median(plain):8.3f} ms/step"
            f"  ddpdoctor {statistics.median(instrumented):8.3f} ms/step"
            f"  overhead {pct(over['overhead'])} [{pct(over['min'])}, {pct(over['max'])}]"
            f"  noise (plain vs plain) {pct(noise['overhead'])} [{pct(noise['min'])}, {pct(noise['max'])}]"
            f"  own {own:.1f} µs/step  ({over['pairs']} pairs x {args.steps} steps)",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rounds, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

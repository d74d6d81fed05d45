"""Real DDP jobs under ``ddpdoctor run``, each beside the same job run plain: rank 0's losses and
final parameters must be bit-identical, the log must be timed on the job's clock (CUDA events on a GPU), and the report
must read it. The scenarios are PyTorch's own DDP features that a user turns on, and what real
training loops put around DDP: a sparse embedding's gradient, SyncBatchNorm (GPU only),
``ZeroRedundancyOptimizer``, gradient clipping between the backward and the optimizer step, a
GAN (two DDP models, two optimizers, the discriminator called three times a step).

    python bench/real_jobs.py                         # one GPU, NCCL: every scenario, side by side
    python bench/real_jobs.py --only fp16_hook autocast
    python bench/real_jobs.py --device cpu --nproc 2  # two gloo ranks on CPU (any torch version)

Each job is ``torchrun --standalone --nproc-per-node N bench/real_jobs.py --job SCENARIO``; the
jobs run a few at a time. Deterministic algorithms are on, so two plain runs of a scenario agree
to the bit, and so must the instrumented one. A scenario whose plain job fails (gloo has no
bfloat16 all-reduce on some versions) must fail the same way instrumented, and is listed apart.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = [
    "plain",
    "accumulate",
    "static_graph",
    "find_unused",
    "fp16_hook",
    "bf16_hook",
    "powersgd",
    "autocast",
    "checkpoint",
    "bucket_view",
    "bucket_view_kept",
    "eval_between",
    "join",
    "join_divisor",
    "sparse_embedding",
    "sync_bn",
    "zero",
    "grad_clip",
    "gan",
]
#: SyncBatchNorm reduces its statistics on a GPU only: not run with ``--device cpu``.
CUDA_ONLY = {"sync_bn"}
STEPS = 12
#: A job still running after this long prints every thread's stack and exits.
HANG_S = float(os.environ.get("REAL_JOBS_HANG_S", "120"))


def _job(scenario: str, device_kind: str) -> None:
    """One rank of one scenario (under torchrun): trains STEPS steps, prints ``loss I VALUE``."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.checkpoint import checkpoint

    faulthandler.dump_traceback_later(HANG_S, exit=True)  # a hung job says where, then ends
    torch.use_deterministic_algorithms(True)
    cuda = device_kind == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU())
            self.body = nn.ModuleList(nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4))
            self.head = nn.Linear(256, 8)
            # find_unused: a head used on even steps only (elsewhere DDP would fail on its missing grads)
            self.side = nn.Linear(256, 8) if scenario == "find_unused" else None
            # sparse_embedding: rows looked up from ids the input gives (a sparse gradient)
            self.emb = nn.Embedding(100, 64, sparse=True) if scenario == "sparse_embedding" else None

        def forward(self, x: torch.Tensor, use_side: bool = False) -> torch.Tensor:
            if self.emb is not None:
                x = x + self.emb((x.abs() * 10).long() % 100).mean(dim=1)
            h = self.stem(x)
            for block in self.body:
                h = checkpoint(block, h, use_reentrant=True) if scenario == "checkpoint" else block(h)
            out = self.head(h)
            return out + self.side(h) if use_side and self.side is not None else out

    torch.manual_seed(0)
    net = Net().to(device)
    if scenario == "sync_bn":
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    kwargs: dict[str, Any] = {"bucket_cap_mb": 0.25, "device_ids": [device.index] if cuda else None}
    if scenario == "static_graph":
        kwargs["static_graph"] = True
    if scenario == "find_unused":
        kwargs["find_unused_parameters"] = True
    if scenario in ("bucket_view", "bucket_view_kept"):
        kwargs["gradient_as_bucket_view"] = True
    if scenario == "gan":
        # the discriminator runs forward twice before its backward: a buffer broadcast at the
        # second overwrites what the first saved for backward (torch 2.5.1 refuses it), so GAN
        # scripts turn the broadcast off
        kwargs["broadcast_buffers"] = False
    ddp = DDP(net, **kwargs)
    if scenario == "fp16_hook":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    if scenario == "bf16_hook":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    if scenario == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=3)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt: Any
    if scenario == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    # join: uneven inputs, one batch fewer per rank (world size 1 still runs Join's hooks)
    count = STEPS - rank if scenario in ("join", "join_divisor") else STEPS
    batches = [(torch.randn(32, 64, generator=gen), torch.randn(32, 8, generator=gen)) for _ in range(count)]
    losses: list[torch.Tensor] = []

    def step(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.to(device), y.to(device)
        use_side = scenario == "find_unused" and i % 2 == 0
        if scenario == "accumulate" and i % 2 == 0:
            with ddp.no_sync():
                loss = ((ddp(x, use_side) - y) ** 2).mean()
                loss.backward()
            losses.append(loss.detach())
            return
        if scenario == "autocast":
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = ((ddp(x, use_side).float() - y) ** 2).mean()
        else:
            loss = ((ddp(x, use_side) - y) ** 2).mean()
        loss.backward()
        if scenario == "grad_clip":
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5)
        opt.step()
        # bucket_view_kept: the gradients stay the buckets' views between steps (DDP then divides
        # them in place, which gives other bits than a multiply at 3 ranks)
        opt.zero_grad(set_to_none=scenario != "bucket_view_kept")
        losses.append(loss.detach())
        if scenario == "eval_between" and i % 3 == 2:
            ddp.eval()
            with torch.no_grad():
                ddp(x)
            ddp.train()

    def gan_step(i: int, x: torch.Tensor) -> None:
        """A GAN's step: the discriminator (``ddp``) forward twice before its backward and its
        optimizer, then again inside the generator's step, whose optimizer comes last."""
        x = x.to(device)
        fake = generator(noise[i].to(device))
        d_loss = ddp(x).mean() - ddp(fake.detach()).mean()
        opt.zero_grad(set_to_none=True)
        d_loss.backward()
        opt.step()
        g_loss = -ddp(fake).mean()
        g_opt.zero_grad(set_to_none=True)
        g_loss.backward()
        g_opt.step()
        losses.append(d_loss.detach())
        losses.append(g_loss.detach())

    if scenario == "gan":
        torch.manual_seed(1)
        generator = DDP(nn.Sequential(nn.Linear(16, 64), nn.Tanh()).to(device), **kwargs)
        g_opt = torch.optim.SGD(generator.parameters(), lr=0.05, momentum=0.9)
        noise = [torch.randn(32, 16, generator=gen) for _ in range(count)]
        for i, (x, _) in enumerate(batches):
            gan_step(i, x)
    elif scenario in ("join", "join_divisor"):
        # join_divisor: DDP divides by the ranks still training once one has joined
        with Join([ddp], divide_by_initial_world_size=scenario == "join"):
            for i, (x, y) in enumerate(batches):
                step(i, x, y)
    else:
        for i, (x, y) in enumerate(batches):
            step(i, x, y)
    if rank == 0:
        for i, value in enumerate(losses):
            print(f"loss {i} {float(value).hex()}", flush=True)
        # and the final parameters' bytes: a difference in their last bits may not reach a loss
        values = (v for p in ddp.parameters() for v in p.detach().float().flatten().tolist())
        digest = hashlib.sha256(" ".join(float(v).hex() for v in values).encode())
        print(f"loss params {digest.hexdigest()[:32]}", flush=True)


def _losses(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("loss ")]


def _warnings(stderr: str) -> set[str]:
    """The warning lines, with what differs from run to run (paths, numbers) blanked."""
    return {
        re.sub(r"/\S+|\d+", "_", line.split(": ", 1)[-1])[:160] for line in stderr.splitlines() if "Warning" in line
    }


def run_scenario(scenario: str, device: str, nproc: int, root: Path) -> dict[str, Any]:
    """One scenario's job plain, then under ``ddpdoctor run`` (its run dir under ``root``), then
    ``ddpdoctor report``: exit codes, times, whether rank 0's losses are the same, the warnings the
    instrumented job added, and what the log says (clock, backend, timing route, steps, findings)."""
    job = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    job += [str(Path(__file__).resolve()), "--job", scenario, "--device", device]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONPATH": path}
    run_dir = root / scenario
    t0 = time.perf_counter()
    plain = subprocess.run(job, capture_output=True, text=True, timeout=240, env=env, cwd=root)
    t1 = time.perf_counter()
    wrapped = [sys.executable, "-m", "ddpdoctor", "run", "--run-dir", str(run_dir), "--", *job]
    inst = subprocess.run(wrapped, capture_output=True, text=True, timeout=240, env=env, cwd=root)
    t2 = time.perf_counter()
    report = subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "report", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=root,
    )
    plain_losses, inst_losses = _losses(plain.stdout), _losses(inst.stdout)
    result: dict[str, Any] = {
        "scenario": scenario,
        "plain_rc": plain.returncode,
        "rc": inst.returncode,
        "report_rc": report.returncode,
        "plain_s": t1 - t0,
        "inst_s": t2 - t1,
        "same_losses": bool(plain_losses) and plain_losses == inst_losses,
        "n_losses": len(inst_losses),
        "stderr": [line for line in inst.stderr.splitlines() if line.strip()][-8:],
        "plain_stderr": [line for line in plain.stderr.splitlines() if line.strip()][-8:],
        "report": report.stdout.splitlines()[:40] + report.stderr.splitlines()[-8:],
        # warnings the instrumented job printed and the plain one did not (ddpdoctor's own or torch's)
        "new_warnings": sorted(_warnings(inst.stderr) - _warnings(plain.stderr)),
    }
    try:
        import ddpdoctor

        run = ddpdoctor.load_run(run_dir)
        log = run.ranks[0]
        steps = [s for s in log.steps if not s.summary]
        result.update(
            clock=log.header.clock if log.header else None,
            backend=log.header.backend if log.header else None,
            timing=log.header.timing if log.header else None,
            steps=len(steps),
            per_bucket=sum(1 for s in steps if s.per_bucket()),
            timed=sum(1 for s in steps if s.fwd_us is not None),
            findings=sorted({f.code for f in ddpdoctor.analyze(run).findings}),
        )
    except Exception as exc:  # noqa: BLE001 - reported in the table, the other scenarios go on
        result["load_error"] = f"{type(exc).__name__}: {exc}"
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--nproc", type=int, default=1, help="ranks per job (one GPU: 1, NCCL refuses more)")
    parser.add_argument("--parallel", type=int, default=4, help="jobs at a time")
    args = parser.parse_args()
    if args.job is not None:
        import torch.distributed as dist

        _job(args.job, args.device)
        # after the job's DDP is gone: a gloo rank that freed its DDP after this hung at exit
        # (torch 2.13, CPU: 2 of 5 plain runs, no ddpdoctor in them); a ZeroRedundancyOptimizer
        # sits in reference cycles, and freed after this at exit it aborted plain ranks
        # ("terminate called without an active exception": 2 of 3 plain runs on torch 2.13)
        gc.collect()
        dist.destroy_process_group()
        return 0
    scenarios = args.only or [s for s in SCENARIOS if args.device == "cuda" or s not in CUDA_ONLY]
    failed: list[str] = []
    both_fail: list[str] = []
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.parallel) as pool:
        # each result printed once it and those before it are in: a run stopped at its time limit
        # still shows the scenarios that finished
        for r in pool.map(lambda s: run_scenario(s, args.device, args.nproc, Path(tmp)), scenarios):
            results.append(r)
            if r["plain_rc"] != 0 and r["rc"] == r["plain_rc"]:
                both_fail.append(r["scenario"])  # ddpdoctor changed nothing: the job fails without it too
                print(f"both fail {r['scenario']:<13} rc {r['plain_rc']}/{r['rc']}: {r['plain_stderr'][-1:]}")
                continue
            ok = (
                r["plain_rc"] == 0
                and r["rc"] == 0
                and r["report_rc"] == 0
                and r["same_losses"]
                and r.get("clock") == ("cuda" if args.device == "cuda" else "host")
                and r.get("steps", 0) >= STEPS // 2
            )
            print(
                f"{'SAME' if r['same_losses'] else 'DIFF'} {'ok ' if ok else 'BAD'} {r['scenario']:<13}"
                f" rc {r['plain_rc']}/{r['rc']}/{r['report_rc']} losses {r['n_losses']}"
                f" clock {r.get('clock')} {r.get('backend')} timing {r.get('timing')} steps {r.get('steps')}"
                f" per-bucket {r.get('per_bucket')} timed {r.get('timed')} findings {r.get('findings')}"
                f" plain {r['plain_s']:.1f}s inst {r['inst_s']:.1f}s {r.get('load_error', '')}"
            )
            for line in r["new_warnings"]:
                print(f"    new warning: {line}")
            if not ok:
                failed.append(r["scenario"])
                for key in ("stderr", "plain_stderr", "report"):
                    for line in r[key]:
                        print(f"    {key}: {line}")
    ran = len(results) - len(both_fail)
    print(
        f"{ran - len(failed)}/{ran} scenarios ok"
        + (f"; failed: {failed}" if failed else "")
        + (f"; failing without ddpdoctor too: {both_fail}" if both_fail else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Non-finite gradients, parameters DDP does not reduce, optimizer steps with no all-reduce: real
gloo runs of the zoo scripts (and their healthy look-alikes), read as a user reads them."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import ddpdoctor
from ddpdoctor.analysis import at_least
from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.live_run import LiveRun
from ddpdoctor.analysis.nonfinite import origin_of, rank_nonfinite
from ddpdoctor.events import Fingerprint, GradFlags, decode
from ddpdoctor.runlog import DirSource
from ddpdoctor.runtime.checks.nonfinite import NonFiniteWatch
from tests.zoo_runs import ZooRuns

#: the native hook's non-finite pass and torch's module registration hooks, on every torch CI runs
pytestmark = pytest.mark.torch_compat

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "examples" / "zoo"


def findings(run_dir: Path) -> dict[str, dict[str, Any]]:
    return {f.code: f.to_dict() for f in ddpdoctor.analyze(ddpdoctor.load_run(run_dir)).findings}


def losses(proc: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """Each rank's printed losses (float.hex, exact)."""
    return dict(re.findall(r"^rank (\d) losses: (.*)$", proc.stdout, re.M))


def run_ok(zoo_runs: ZooRuns, script: str, *args: str, env: dict[str, str] | None = None) -> tuple[Any, Path]:
    proc, run_dir = zoo_runs.run(ZOO / f"{script}.py", *args, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, run_dir


def same_losses_as_plain(zoo_runs: ZooRuns, proc: Any, script: str, *args: str) -> None:
    """The losses with ddpdoctor attached are those of the same script without it, to the bit."""
    plain, _ = run_ok(zoo_runs, script, *args, "--plain")
    assert len(losses(proc)) == 2 and losses(proc) == losses(plain)


# -- non-finite-gradient -----------------------------------------------------------------------


@pytest.mark.parametrize("route", ["native", "python"])
def test_a_nan_on_rank_1_at_step_12_is_named_with_its_origin(zoo_runs: ZooRuns, native_built: Path, route: str) -> None:
    env = {"DDPDOCTOR_NATIVE": "0"} if route == "python" else None
    proc, run_dir = run_ok(zoo_runs, "nonfinite_one_rank", env=env)
    run = ddpdoctor.load_run(run_dir)
    assert {log.header.timing for log in run.ranks.values() if log.header} == {route}
    f = findings(run_dir)["non-finite-gradient"]
    assert f["severity"] == "error" and f["ranks"] == [1] and f["step"] == 12
    ev = f["evidence"]
    assert ev["origin_ranks"] == [1] and ev["together"] is False
    assert ev["first_step_by_rank"] == {"0": 13, "1": 12}  # rank 0 only after the all-reduce
    (bucket,) = ev["buckets_by_rank"]["1"]
    assert bucket["bucket"] == 0
    counts = {p["name"]: (p["nan"], p["inf"]) for p in bucket["params"]}
    assert counts["body.0.weight"] == (64 * 32, 0) and counts["head.bias"] == (4, 0)
    assert "rank 1 at step 12 is the origin" in f["title"] and "rank 0 at step 13" in f["detail"]
    # said live on each rank, in its own category, and logged
    assert "NonFiniteGradientWarning: ddpdoctor [rank 1] non-finite-gradient" in proc.stderr
    assert "Unknown" not in proc.stderr
    assert run.ranks[0].unknown_lines == 0  # the NaN fingerprints are read, not dropped
    if route == "native":
        same_losses_as_plain(zoo_runs, proc, "nonfinite_one_rank")


def test_the_live_view_names_the_origin_rank(zoo_runs: ZooRuns, native_built: Path) -> None:
    _, run_dir = run_ok(zoo_runs, "nonfinite_one_rank")
    source = DirSource(run_dir)
    try:
        live = LiveRun(label="nan")
        live.feed(source.poll())
    finally:
        source.close()
    shown = [f for f in live.snapshot().findings if f.code == "non-finite-gradient"]
    assert len(shown) == 1  # the cross-rank verdict, not one per rank
    assert shown[0].ranks == [1] and shown[0].step == 12 and "origin" in shown[0].title


def test_every_rank_going_nan_together_blames_none(zoo_runs: ZooRuns, native_built: Path) -> None:
    proc, run_dir = run_ok(zoo_runs, "nonfinite_all_ranks")
    f = findings(run_dir)["non-finite-gradient"]
    assert f["ranks"] == [0, 1] and f["evidence"]["together"] is True
    assert "every rank together" in f["title"] and "origin" not in f["title"]
    assert "learning rate" in f["fix"]
    same_losses_as_plain(zoo_runs, proc, "nonfinite_all_ranks")


def test_a_large_but_finite_loss_is_silent(zoo_runs: ZooRuns, native_built: Path) -> None:
    proc, run_dir = run_ok(zoo_runs, "large_finite_loss")
    assert "non-finite-gradient" not in findings(run_dir)
    assert "non-finite" not in proc.stderr
    assert float.fromhex(losses(proc)["0"].split()[0]) > 1e28  # large indeed
    same_losses_as_plain(zoo_runs, proc, "large_finite_loss")


def _ranked(steps: dict[int, int]) -> dict[int, Finding]:
    return {
        r: rank_nonfinite(r, s, [{"bucket": 0, "params": [{"name": "w", "nan": 1, "inf": 0}]}])
        for r, s in steps.items()
    }


def test_the_origin_rule_across_ranks() -> None:
    one = origin_of(_ranked({0: 5, 1: 4, 2: 5, 3: 5}), 4)
    assert one is not None and one.ranks == [1] and not one.evidence["together"]
    most = origin_of(_ranked({0: 5, 1: 5, 2: 5, 3: 6}), 4)
    assert most is not None and most.ranks == [0, 1, 2] and most.evidence["together"]
    assert "3 of 4 ranks" in most.title
    two_of_eight = origin_of(_ranked({0: 9, 3: 7, 5: 7}), 8)
    assert two_of_eight is not None and two_of_eight.ranks == [3, 5] and not two_of_eight.evidence["together"]
    alone = origin_of(_ranked({1: 3}), 2)  # the other rank never logged one of its own
    assert alone is not None and alone.ranks == [1] and "No other rank" in alone.detail
    assert origin_of({}, 2) is None


class _Bucket:
    """What the Python comm hook hands the check: a bucket's buffer, index, parameters, views."""

    def __init__(self, index: int, params: list[torch.Tensor]) -> None:
        self._index = index
        self._params = params
        self._buffer = torch.cat([p.detach().reshape(-1) for p in params])
        views, at = [], 0
        for p in params:
            views.append(self._buffer[at : at + p.numel()].view_as(p))
            at += p.numel()
        self._views = views

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        return self._views


class _Module:
    def __init__(self, net: torch.nn.Module) -> None:
        self.module = net


def test_the_python_check_names_the_parameter_and_its_counts() -> None:
    net = torch.nn.Linear(3, 2)
    watch = NonFiniteWatch(_Module(net), rank=0)
    watch.check_bucket(_Bucket(0, [net.weight, net.bias]), -1)
    assert watch.word.value == 0  # finite: nothing said
    with torch.no_grad():
        net.bias[1] = float("inf")
        net.weight[0, 0] = float("nan")
    watch.check_bucket(_Bucket(2, [net.weight, net.bias]), -1)
    assert watch.word.value == 1
    found = watch.take(7)
    assert found is not None and found.step == 7 and watch.word.value == 0
    (bucket,) = found.evidence["buckets"]
    assert bucket == {
        "bucket": 2,
        "params": [{"name": "weight", "nan": 1, "inf": 0}, {"name": "bias", "nan": 0, "inf": 1}],
    }


def _device_route(device: str) -> None:
    """The device route's logic: flags folded per bucket, copied at a sampled step, read once
    the copy has passed; the step known to within the steps the copy covers."""
    net = torch.nn.Linear(4, 4).to(device)
    watch = NonFiniteWatch(_Module(net), rank=1)
    good = torch.ones(16, device=device)
    watch._fold_device(0, good)
    watch._fold_device(1, good)
    assert watch.poll(5, start_copy=True) is None  # steps 0-4 copied
    deadline = 0
    while watch._event is not None and watch._event is not True and not watch._event.query() and deadline < 10**7:
        deadline += 1  # (a poll, as the monitor's next forwards would: never a wait on the device)
    assert watch.poll(6, start_copy=False) is None  # read: all finite
    bad = good.clone().double()  # (a float64 bucket: reduced in its own dtype)
    bad[3] = float("nan")
    watch._fold_device(1, bad)  # at step 7
    watch._fold_device(0, good.half())
    assert watch.poll(8, start_copy=False) is None  # not copied yet
    watch.poll(10, start_copy=True)  # steps 5-9 copied
    while watch._event is not True and not watch._event.query():
        pass
    found = watch.poll(11, start_copy=False)
    assert found is not None and found.step == 5 and found.evidence["last_step"] == 9
    assert [b["bucket"] for b in found.evidence["buckets"]] == [1]
    assert "steps 5-9" in found.title


def test_the_device_route_logic_on_cpu_tensors() -> None:
    _device_route("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_device_route_on_cuda_never_synchronizes() -> None:
    torch.cuda.set_sync_debug_mode("error")  # any synchronization inside raises
    try:
        _device_route("cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")


# -- param-not-reduced -------------------------------------------------------------------------


def test_a_weight_replaced_after_wrapping_is_named_not_called_unused(zoo_runs: ZooRuns) -> None:
    proc, run_dir = run_ok(zoo_runs, "param_replaced_after_wrap")
    found = findings(run_dir)
    f = found["param-not-reduced"]
    assert f["severity"] == "error" and f["ranks"] == [0, 1] and f["step"] == 6
    assert f["evidence"]["replaced"] == ["head.weight"] and f["evidence"]["added"] == []
    assert "not an unused parameter to delete" in f["detail"] and "ddpdoctor.rewrap(model)" in f["fix"]
    # the orphan is not called unused, and nothing advises deleting it
    assert "unused-parameters" not in found
    assert not any("delete" in g["fix"] or "remove the unused" in g["fix"] for g in found.values())
    # the replica check follows the module's current weight by name, so its drift is seen
    assert found["replica-divergence"]["evidence"]["names"] == ["head.weight"]
    assert found["replica-divergence"]["step"] > f["step"]
    assert "NotSynchronizedWarning: ddpdoctor [rank 0] param-not-reduced" in proc.stderr
    same_losses_as_plain(zoo_runs, proc, "param_replaced_after_wrap")


def test_a_head_reassigned_after_wrapping_is_named(zoo_runs: ZooRuns) -> None:
    proc, run_dir = run_ok(zoo_runs, "head_reassigned_after_wrap")
    found = findings(run_dir)
    f = found["param-not-reduced"]
    assert f["step"] == 8 and sorted(f["evidence"]["replaced"]) == ["head.bias", "head.weight"]
    assert "unused-parameters" not in found
    assert set(found["replica-divergence"]["evidence"]["names"]) == {"head.weight", "head.bias"}
    same_losses_as_plain(zoo_runs, proc, "head_reassigned_after_wrap")


@pytest.mark.parametrize("how", ["--before", "--rewrap"])
def test_a_replacement_before_wrapping_or_rewrapped_is_silent(zoo_runs: ZooRuns, how: str) -> None:
    proc, run_dir = run_ok(zoo_runs, "param_replaced_after_wrap", how)
    found = findings(run_dir)
    for code in ("param-not-reduced", "replica-divergence", "unused-parameters", "non-finite-gradient"):
        assert code not in found
    assert at_least(list(ddpdoctor.analyze(ddpdoctor.load_run(run_dir)).findings), "error") == []
    assert "param-not-reduced" not in proc.stderr
    # (the script keeps find_unused_parameters=True as the broken one has it: that warning is right)
    assert set(found) <= {"find-unused-unneeded", "exposed-communication"}


# -- gradients-never-synchronized -------------------------------------------------------------


@pytest.mark.parametrize("variant", [(), ("--first",)])
def test_optimizer_steps_with_no_all_reduce_are_named_within_two(zoo_runs: ZooRuns, variant: tuple[str, ...]) -> None:
    proc, run_dir = run_ok(zoo_runs, "accumulation_never_synced", *variant)
    f = findings(run_dir)["gradients-never-synchronized"]
    assert f["severity"] == "error" and f["ranks"] == [0, 1]
    assert f["evidence"]["optimizer_steps"] == 2  # named at the second optimizer step
    assert f["evidence"]["ever_synchronized"] is bool(variant)
    assert "no_sync()" in f["detail"] and "(i + 1) % accumulation_steps == 0" in f["fix"]
    assert "NotSynchronizedWarning: ddpdoctor [rank 1] gradients-never-synchronized" in proc.stderr
    # before any drift: the warning is on stderr before the replicas are compared at the end
    run = ddpdoctor.load_run(run_dir)
    logged = next(r for r in run.ranks[0].findings if r.code == "gradients-never-synchronized")
    assert logged.evidence["backwards_in_no_sync"] <= 8
    same_losses_as_plain(zoo_runs, proc, "accumulation_never_synced", *variant)


def test_accumulation_done_right_is_silent(zoo_runs: ZooRuns) -> None:
    proc, run_dir = run_ok(zoo_runs, "accumulation_never_synced", "--right")
    found = findings(run_dir)
    for code in ("gradients-never-synchronized", "sync-during-accumulation", "replica-divergence"):
        assert code not in found
    warned = at_least(list(ddpdoctor.analyze(ddpdoctor.load_run(run_dir)).findings), "warning")
    # (a busy machine can leave the all-reduce exposed: a measured cost, said of any run, not a
    # diagnosis of this one)
    assert {f.code for f in warned} <= {"exposed-communication"}, warned
    assert "Warning: ddpdoctor" not in proc.stderr


# -- the log stays readable ---------------------------------------------------------------------


def test_old_and_non_finite_records_decode() -> None:
    old = decode(b'{"kind":"grad_flags","rank":0,"step":3,"frozen":["a"]}')
    assert isinstance(old, GradFlags) and old.replaced == [] and old.added == []
    nan = decode(b'{"kind":"fingerprint","rank":0,"step":5,"param_norms":[null,1.0],"param_bits":[1,2]}')
    assert isinstance(nan, Fingerprint) and nan.param_norms == [None, 1.0]


def test_a_skipped_step_with_finite_weights_is_a_warning_not_an_error() -> None:
    skipped = {
        r: rank_nonfinite(r, 4, [{"bucket": 0, "params": [{"name": "w", "nan": 0, "inf": 3}]}], weights_finite=True)
        for r in (0, 1)
    }
    verdict = origin_of(skipped, 2)
    assert verdict is not None and verdict.severity == "warning" and "skipped" in verdict.title
    assert "GradScaler" in verdict.detail
    spread = origin_of({0: skipped[0], 1: rank_nonfinite(1, 4, [], weights_finite=False)}, 2)
    assert spread is not None and spread.severity == "error"


SENTINEL_SCRIPT = textwrap.dedent(
    """
    import socket, torch, torch.distributed as dist
    from torch import nn
    import ddpdoctor
    from ddpdoctor.events import Fingerprint, GradFlags
    from ddpdoctor.runtime.checks import sampled as sampled_checks
    from ddpdoctor.runtime.checks.fingerprints import fold_bits, tensor_bits
    from ddpdoctor.sinks.memory import MemorySink
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ddp = nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
    sink = MemorySink()
    monitor = ddpdoctor.instrument(ddp, sink=sink, check_every=4)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    def step():
        opt.zero_grad(); ddp(torch.randn(3, 4)).sum().backward(); opt.step()
    for i in range(12):
        if i == 5:
            ddp.module[1].weight = nn.Parameter(torch.ones(2, 4))
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        if i == 6:
            ddp.module.extra = nn.Linear(2, 2)
        step()
    # modules built at every step that never touch the model: the hooks go after IDLE_WALKS walks
    for i in range(sampled_checks.IDLE_WALKS + 2):
        nn.Linear(2, 2)
        step()
    hooks_gone = monitor.checks._registration_hooks == []
    monitor.close()  # (its final fingerprint: the weights as the run ends)
    flags = [r for r in sink.records if isinstance(r, GradFlags)]
    print("@", [(r.step, r.replaced, r.added) for r in flags])
    last = [r for r in sink.records if isinstance(r, Fingerprint)][-1]
    now = fold_bits(int(tensor_bits([ddp.module[1].weight.detach()])[0]))
    print("@", last.final and last.param_bits[2] == now)
    print("@", hooks_gone)
    dist.destroy_process_group()
    """
)


def test_the_sentinel_names_a_replacement_at_the_next_forward_and_follows_it(native_built: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SENTINEL_SCRIPT], capture_output=True, text=True, timeout=180, check=False, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line[2:] for line in out.stdout.splitlines() if line.startswith("@ ")]
    # step 5's forward sees the replaced weight, step 6's the added head: each from its own step
    assert lines[0] == "[(5, ['1.weight'], []), (6, ['1.weight'], ['extra.weight', 'extra.bias'])]", out.stdout
    assert lines[1] == "True"  # the fingerprint reads the module's weight now, not DDP's orphan
    assert lines[2] == "True"
    assert "param-not-reduced" in out.stderr and "NotSynchronizedWarning" in out.stderr


def test_unused_parameters_tells_an_orphan_from_a_truly_unused_one() -> None:
    from ddpdoctor.analysis.unused import static_unused_set, unused_parameters
    from ddpdoctor.events import Header, ParamInfo, Unused

    header = Header(
        rank=0,
        ddp_options={"find_unused_parameters": True},
        params=[
            ParamInfo(name=n, shape=[2], dtype="float32", numel=2, requires_grad=True)
            for n in ("aux.weight", "fc.weight")
        ],
    )
    both = [Unused(rank=0, step=s, names=["aux.weight", "fc.weight"]) for s in (1, 3, 7)]
    (f,) = unused_parameters(header, both, [], 0, orphaned=["fc.weight"])
    assert f.evidence["names"] == ["aux.weight"] and f.evidence["orphaned"] == ["fc.weight"]
    assert "fc.weight also got none" in f.detail and "param-not-reduced" in f.detail
    orphan_only = [Unused(rank=0, step=s, names=["fc.weight"]) for s in (1, 3, 7)]
    assert unused_parameters(header, orphan_only, [], 0, orphaned=["fc.weight"]) == []
    assert static_unused_set(header, orphan_only, [], 0, orphaned=["fc.weight"]) == []
    # without the orphan's name it would have been called unused (and its deletion advised)
    (wrong,) = unused_parameters(header, orphan_only, [], 0)
    assert "delete them" in wrong.fix

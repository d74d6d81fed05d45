"""The native comm hook (``ddpdoctor/runtime/step/native_hook.py``) on real 2-rank gloo DDP.

Per-bucket ready <= launch <= done on every step, losses bit-identical to plain DDP under every
DDP option, ``DDPDOCTOR_NATIVE=0`` and a failed build taking the Python route with one warning,
and a user's hook registered after ``instrument`` (before or after training started) still
applied and timed. The extension is built once per session (cached in torch's extension dir).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor
from ddpdoctor import native_cache
from ddpdoctor.events import Header, Layout, Step
from ddpdoctor.runtime.step import native_hook
from ddpdoctor.sinks.memory import MemorySink
from tests.ddp_harness import run_ranks
from tests.models import make_model
from tests.runtime_workers import BUCKET_CAP_MB, sum_hook, train

pytestmark = pytest.mark.torch_compat

_ONCE = "can only be called once"


def _records(sink: MemorySink) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {"header": [], "step": [], "layout": []}
    for r in sink.records:
        if isinstance(r, Header):
            out["header"].append(r)
        elif isinstance(r, Step):
            out["step"].append(r)
        elif isinstance(r, Layout):
            out["layout"].append(r)
    return out


def _summary(sink: MemorySink) -> dict[str, Any]:
    recs = _records(sink)
    return {
        "timing": [h.timing for h in recs["header"]],
        "steps": [
            (s.b_ready_us, s.b_launch_us, s.b_done_us, s.b_bytes, s.bwd_end_us, s.sync_end_us) for s in recs["step"]
        ],
        "layouts": [
            (lay.reason, [(b.index, b.params, b.bytes, b.dtype) for b in lay.buckets], lay.comm_hook)
            for lay in recs["layout"]
        ],
    }


def _instrumented(
    rank: int, options: dict[str, Any], steps: int = 6, eval_mode: bool = False
) -> tuple[list[float], dict[str, Any], list[str]]:
    sink = MemorySink()
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB, **options)
    if eval_mode:
        ddp.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = ddpdoctor.instrument(ddp, sink=sink)
        losses = train(ddp, rank, steps)
        monitor.close()
    said = [f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, ddpdoctor.DDPDoctorWarning)]
    return losses, _summary(sink), said


VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "static_graph": {"static_graph": True},
    "find_unused": {"find_unused_parameters": True},
    "bucket_view": {"gradient_as_bucket_view": True},
}


def native_checks(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": rank, "variants": {}}
    # train() runs a no_sync micro-step before every third step
    for name, options in VARIANTS.items():
        plain = train(DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB, **options), rank)
        out["variants"][name] = (plain, *_instrumented(rank, options))

    # compiled autograd asked for: the backward is timed from Python (it would not take the C++ hook)
    import torch._dynamo.config as dynamo_config

    python_starts: list[int] = []
    on_output_grad = native_hook.NativeTiming.on_output_grad

    def counted(self: native_hook.NativeTiming, step: Any) -> None:
        python_starts.append(step.index)
        on_output_grad(self, step)

    native_hook.NativeTiming.on_output_grad = counted  # type: ignore[method-assign]  # counts the Python route's backward starts
    dynamo_config.compiled_autograd = True
    try:
        out["compiled_autograd_asked"] = (*_instrumented(rank, {}), sorted(set(python_starts)))
    finally:
        dynamo_config.compiled_autograd = False
        native_hook.NativeTiming.on_output_grad = on_output_grad  # type: ignore[method-assign]  # restored
    # trained in eval mode (a way to freeze BatchNorm): DDP all-reduces as in train mode
    plain = train(DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB).eval(), rank)
    out["eval_mode"] = (plain, *_instrumented(rank, {}, eval_mode=True))

    os.environ[native_hook.ENV] = "0"
    out["forced_python"] = _instrumented(rank, {})
    del os.environ[native_hook.ENV]

    # a user's hook registered after instrument: before training, and after some steps
    calls_plain: list[int] = []
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    ddp.register_comm_hook(calls_plain, sum_hook)
    out["sum_plain"] = train(ddp, rank)
    calls_late: list[int] = []
    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    out["late_plain"] = train(ddp, rank, steps=3)
    ddp.register_comm_hook(calls_late, sum_hook)
    out["late_plain"] += train(ddp, rank, steps=3)
    out["late_plain_calls"] = len(calls_late)
    for when in ("before_training", "after_3_steps"):
        calls: list[int] = []
        sink = MemorySink()
        ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
        monitor = ddpdoctor.instrument(ddp, sink=sink)
        if when == "before_training":
            ddp.register_comm_hook(calls, sum_hook)
            losses = train(ddp, rank)
        else:
            losses = train(ddp, rank, steps=3)
            ddp.register_comm_hook(calls, sum_hook)
            losses += train(ddp, rank, steps=3)
        try:
            ddp.register_comm_hook(None, sum_hook)
            second = "accepted"
        except RuntimeError as exc:
            second = str(exc)
        monitor.close()
        out[when] = (losses, len(calls), second, _summary(sink))
    out["sum_plain_calls"] = len(calls_plain)
    # outputs that are leaves (a parameter returned as it is): beside a computed output, and alone
    for only in (False, True):
        plain = _train_leafy(DDP(_Leafy(only), bucket_cap_mb=BUCKET_CAP_MB), rank)
        sink = MemorySink()
        ddp = DDP(_Leafy(only), bucket_cap_mb=BUCKET_CAP_MB)
        monitor = ddpdoctor.instrument(ddp, sink=sink)
        instrumented = _train_leafy(ddp, rank)
        hooks_left = len(ddp.module.scale._backward_hooks or {})
        monitor.close()
        out[f"leaf_output_{'only' if only else 'mixed'}"] = (plain, instrumented, _summary(sink), hooks_left)
    # a reentrant checkpoint around the last layer: its bucket is ready in the inner backward
    plain = _train_plain(DDP(_CheckpointedHead(), bucket_cap_mb=BUCKET_CAP_MB), rank)
    sink = MemorySink()
    ddp = DDP(_CheckpointedHead(), bucket_cap_mb=BUCKET_CAP_MB)
    monitor = ddpdoctor.instrument(ddp, sink=sink)
    losses = _train_plain(ddp, rank)
    monitor.close()
    out["reentrant"] = (plain, losses, _summary(sink))
    out["phases"] = _phases_around_the_optimizer(rank)
    # the hook's clock is the one of time.perf_counter_ns
    module = native_hook.load()
    before = time.perf_counter_ns()
    native = module.clock_ns()
    after = time.perf_counter_ns()
    out["clock"] = (before, native, after)
    return out


def _phases_around_the_optimizer(rank: int) -> list[str]:
    """Where the hang watchdog would place a stall after the backward, inside the optimizer step
    (stamped in C++, not yet taken into the step) and after it, for two steps."""
    from ddpdoctor.runtime.process.watchdog import locate
    from tests.models import batches

    ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    monitor = ddpdoctor.instrument(ddp, sink=MemorySink())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    phases: list[str] = []

    def where(*_: Any) -> None:
        found = locate(
            monitor.recorder,
            monitor.hooks.buckets_in_flight(),
            monitor.hooks.backward_ended_in_flight(),
            monitor.hooks.optimizer_running(),
        )
        phases.append(found["phase"])

    opt.register_step_pre_hook(where)  # runs after torch's global pre-hooks: inside the step
    for x, y in batches(rank, 2):
        ((ddp(x) - y) ** 2).mean().backward()
        where()
        opt.step()
        where()
        opt.zero_grad()
    monitor.close()
    return phases


class _CheckpointedHead(torch.nn.Module):
    """Its last layer in a reentrant checkpoint: that layer's gradients (the first bucket) come
    from a backward run inside the backward, which ends before the outer one does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
        self.head = torch.nn.Linear(256, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.head, torch.relu(self.body(x)), use_reentrant=True)


def _train_plain(ddp: DDP, rank: int, steps: int = 6) -> list[float]:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        loss = ddp(torch.randn(8, 16, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class _Leafy(torch.nn.Module):
    """Returns one of its parameters as it is, a leaf with no autograd node: beside a computed
    output, or (``only``) with the other output detached."""

    def __init__(self, only: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.only = only
        self.lin = torch.nn.Linear(16, 16)
        self.scale = torch.nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        return (y.detach() if self.only else y), self.scale


def _train_leafy(ddp: DDP, rank: int, steps: int = 6) -> list[float]:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        y, scale = ddp(torch.randn(8, 16, generator=gen))
        # with only the leaf output in the graph, lin's gradient is zero, not missing (no
        # find_unused_parameters needed)
        loss = (y * scale).pow(2).mean() + scale.sum() + 0.0 * sum(p.sum() for p in ddp.module.lin.parameters())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def fallback_checks(rank: int, world_size: int) -> dict[str, Any]:
    """The build fails (``DDPDOCTOR_TEST_NATIVE_FAULT=compile``): the Python route, one warning."""
    plain = train(DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB), rank)
    first = _instrumented(rank, {})
    second = _instrumented(rank, {})
    return {"plain": plain, "first": first, "second": second, "problem": native_hook._problem}


@pytest.fixture(scope="module")
def native(native_built: Path) -> list[dict[str, Any]]:
    return run_ranks(native_checks, 2, timeout=240)


def _check_marks(summary: dict[str, Any], buckets: int, steps: int = 6) -> None:
    """Every step has every bucket's marks (``buckets`` once DDP rebuilt them)."""
    assert len(summary["steps"]) == steps, "a step is missing"
    assert len(summary["steps"][-1][0]) == buckets
    for i, (ready, launch, done, nbytes, bwd_end, sync_end) in enumerate(summary["steps"]):
        assert len(ready) == len(launch) == len(done) == len(nbytes) >= 1
        assert sum(nbytes) == sum(summary["steps"][-1][3])  # every gradient byte, in every step
        for r, la, d in zip(ready, launch, done, strict=True):
            assert r is not None and la is not None and d is not None
            assert 0 < r <= la <= d
        assert bwd_end is not None
        if i > 0:  # (static_graph's first step all-reduces from DDP's own final callback, later)
            assert bwd_end >= max(ready)  # backward compute ends after its last bucket is ready
        assert sync_end == max(done)


def test_native_timing_every_bucket_every_step_and_identical_losses(native: list[dict[str, Any]]) -> None:
    for r in native:
        for name, (plain, losses, summary, said) in r["variants"].items():
            assert losses == plain, name  # exact float equality, every step
            assert not [w for w in said if "native" in w or "comm hook" in w], name
            assert summary["timing"] == ["native"], name
            buckets = len(summary["steps"][-1][0])
            assert buckets >= 3, name  # BUCKET_CAP_MB splits the model
            _check_marks(summary, buckets)


def test_native_layout_names_every_parameter(native: list[dict[str, Any]]) -> None:
    names = {n for n, _ in make_model().named_parameters()}
    for r in native:
        summary = r["variants"]["default"][2]
        reasons = [reason for reason, _, _ in summary["layouts"]]
        assert reasons[0] == "initial"
        _, buckets, hook = summary["layouts"][-1]
        assert hook is None
        assert {p for _, params, _, _ in buckets for p in params} == names
        assert all(dtype == "float32" and nbytes > 0 for _, _, nbytes, dtype in buckets)
        # the layout's bytes are the steps' bytes
        assert [nbytes for _, _, nbytes, _ in buckets] == summary["steps"][-1][3]


def test_a_parameter_returned_as_an_output_is_timed_and_leaves_no_hook_behind(native: list[dict[str, Any]]) -> None:
    # nothing is hooked on the output (the first bucket queues the backward's end): a parameter
    # returned as it is is timed like any output, and keeps no hook
    for r in native:
        for case in ("leaf_output_mixed", "leaf_output_only"):
            plain, instrumented, summary, hooks_left = r[case]
            assert instrumented == plain, case
            assert summary["timing"] == ["native"], case
            _check_marks(summary, buckets=len(summary["steps"][-1][0]))
            assert hooks_left == 0, case


def test_a_reentrant_backward_inside_the_backward_does_not_end_it(native: list[dict[str, Any]]) -> None:
    # the first bucket is ready inside a reentrant checkpoint's own backward, which ends first:
    # the backward's end is the outer one's, after every bucket is ready (_check_marks)
    for r in native:
        plain, losses, summary = r["reentrant"]
        assert losses == plain
        assert summary["timing"] == ["native"]
        buckets = len(summary["steps"][-1][0])
        assert buckets >= 2
        _check_marks(summary, buckets)


def test_with_compiled_autograd_asked_for_the_backward_is_timed_from_python(native: list[dict[str, Any]]) -> None:
    plain = {r["rank"]: r["variants"]["default"][0] for r in native}
    for r in native:
        losses, summary, said, python_starts = r["compiled_autograd_asked"]
        assert python_starts == list(range(6))  # every step's backward began in Python
        assert losses == plain[r["rank"]]
        assert summary["timing"] == ["native"]  # the buckets still by the native hook
        assert not said
        _check_marks(summary, buckets=len(summary["steps"][-1][0]))


def test_training_in_eval_mode_is_timed_like_training(native: list[dict[str, Any]]) -> None:
    for r in native:
        plain, losses, summary, said = r["eval_mode"]
        assert losses == plain
        assert summary["timing"] == ["native"]
        # (BatchNorm's buffers do not change in eval mode: constant-buffers is right to say so)
        assert not [w for w in said if "native" in w or "comm hook" in w], said
        _check_marks(summary, buckets=len(summary["steps"][-1][0]))


def test_native_env_zero_takes_the_python_route(native: list[dict[str, Any]]) -> None:
    for r in native:
        losses, summary, said = r["forced_python"]
        assert losses == r["variants"]["default"][0]
        assert said == []
        assert summary["timing"] == ["python"]
        _check_marks(summary, len(summary["steps"][-1][0]))


def test_user_hook_after_instrument_is_applied_and_timed(native: list[dict[str, Any]]) -> None:
    for r in native:
        for when in ("before_training", "after_3_steps"):
            losses, calls, second, summary = r[when]
            plain = "sum_plain" if when == "before_training" else "late_plain"
            assert losses == r[plain], when  # the user's hook (a sum, not a mean) applied
            assert calls == r[f"{plain}_calls"] > 0, when
            assert _ONCE in second, when  # a second hook: DDP's own error, as without ddpdoctor
            assert summary["timing"] == ["native"]
            assert summary["layouts"][-1][2] == "sum_hook"  # the layout names the user's hook
            _check_marks(summary, len(summary["steps"][-1][0]))


def test_a_stall_inside_the_optimizer_step_is_placed_there(native: list[dict[str, Any]]) -> None:
    # the optimizer's stamps are taken into the step at the next forward: until then the
    # watchdog reads whether a step started and has not ended from the C++ hooks
    for r in native:
        assert r["phases"] == ["between steps", "optimizer", "between steps"] * 2


def test_native_clock_is_perf_counter(native: list[dict[str, Any]]) -> None:
    for r in native:
        before, native_ns, after = r["clock"]
        assert before <= native_ns <= after


def test_build_failure_falls_back_once_and_training_is_unaffected(
    native_built: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(native_hook.FAULT_ENV, "compile")
    results = run_ranks(fallback_checks, 2, timeout=240)
    for r in results:
        assert "the build failed" in r["problem"]
        for i, key in enumerate(("first", "second")):
            losses, summary, said = r[key]
            assert losses == r["plain"]
            assert summary["timing"] == ["python"]
            _check_marks(summary, len(summary["steps"][-1][0]))
            # said once per process: at the first instrument only
            if i == 0:
                assert len(said) == 1 and said[0].startswith("CommHookWarning: ddpdoctor: the native comm hook"), said
            else:
                assert said == []


def test_build_is_cached(native_built: Path) -> None:
    t = time.perf_counter()
    assert native_hook.build() == native_built
    assert time.perf_counter() - t < 1.0  # a cached build is a file check
    name = native_hook.extension_name()
    assert torch.__version__.split("+")[0].replace(".", "_") in name
    assert not dist.is_initialized()


def test_the_build_is_a_release_build_named_by_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """The extension is built with NDEBUG, as torch is (without it pybind11 checks the GIL at
    every reference count change), and its flags are part of its name: a build cached with other
    flags is never loaded as this one."""
    assert "-DNDEBUG" in native_cache.CFLAGS
    name = native_hook.extension_name()
    monkeypatch.setattr(native_cache, "CFLAGS", ("-O2",))
    assert native_hook.extension_name() != name


def test_the_launcher_finds_the_cached_build_without_importing_torch(
    native_built: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ddpdoctor run`` looks the build up by the name the ranks will load, from torch's version
    file: a launch with a cached build imports no torch (a child process importing it took 2.5 s)."""
    code = (
        "import sys; from ddpdoctor import native_cache; p = native_cache.cached_build(); "
        "print(p); print('torch' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != native_hook.FAULT_ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == [str(native_built), "False"]
    monkeypatch.setenv(native_hook.FAULT_ENV, "compile")  # another source: another name, not built
    assert native_cache.cached_build() is None


def test_a_rank_loads_the_cached_build_without_torchs_build_tools(native_built: Path) -> None:
    """A rank that loads the cached extension and trains on the native route imports neither
    ``torch.utils.cpp_extension`` nor setuptools where plain DDP did not (that import put
    setuptools and distutils in the training process, and on a CUDA build without a CUDA runtime
    a warning on every rank's stderr); the cache it looks in is the one torch's own function
    names."""
    code = textwrap.dedent(
        """
        import os, sys, socket, torch, torch.distributed as dist
        from torch import nn
        import ddpdoctor
        from ddpdoctor.runtime.step import native_hook
        from ddpdoctor.sinks.memory import MemorySink
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
        names = ("torch.utils.cpp_extension", "setuptools")
        plain = [name in sys.modules for name in names]  # (an older DDP imports dynamo, which may import setuptools)
        monitor = ddpdoctor.instrument(ddp, sink=MemorySink())
        for _ in range(3):
            ddp(torch.randn(2, 4)).sum().backward()
        monitor.close()
        print("@", monitor.attachment.header.timing, [name in sys.modules for name in names] == plain, plain[0])
        print("@", native_hook.build_directory("x"))
        from torch.utils.cpp_extension import get_default_build_root
        print("@", os.path.join(get_default_build_root(), "x"))
        dist.destroy_process_group()
        """
    )
    env = {k: v for k, v in os.environ.items() if k != native_hook.FAULT_ENV}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line[2:] for line in out.stdout.splitlines() if line.startswith("@ ")]  # (gloo may print too)
    assert lines[0] == "native True False", out.stdout  # (nothing added; no cpp_extension before either)
    assert lines[1] == lines[2]


def test_run_launcher_builds_first_and_tells_the_ranks_when_it_cannot(
    native_built: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddpdoctor import native_cache
    from ddpdoctor.cli.run_cmd import prepare_native

    monkeypatch.setattr(native_cache, "gpu_visible", lambda environ=None, dev=None: False)  # (a CPU host)
    env: dict[str, str] = {}
    prepare_native(env, "ddpdoctor run", gpu_skips=True)  # built: nothing to tell the ranks
    assert native_hook.ENV not in env
    monkeypatch.setenv(native_hook.FAULT_ENV, "compile")
    prepare_native(env, "ddpdoctor run", gpu_skips=True)
    assert env[native_hook.ENV] == "0"  # the ranks take the Python route at once, without trying
    err = capsys.readouterr().err
    assert err.count("ddpdoctor run: warning:") == 1 and "Python comm hook" in err


def test_run_launcher_builds_nothing_where_the_job_would_see_a_gpu(tmp_path: Path) -> None:
    from ddpdoctor import native_cache

    dev = tmp_path / "dev"
    dev.mkdir()
    assert not native_cache.gpu_visible({}, dev)
    (dev / "nvidiactl").touch()  # the driver's control node alone is no GPU
    assert not native_cache.gpu_visible({}, dev)
    (dev / "nvidia0").touch()
    assert native_cache.gpu_visible({}, dev)
    assert native_cache.gpu_visible({"CUDA_VISIBLE_DEVICES": "0"}, dev)
    assert not native_cache.gpu_visible({"CUDA_VISIBLE_DEVICES": ""}, dev)  # hidden: a CPU job
    assert not native_cache.gpu_visible({"CUDA_VISIBLE_DEVICES": "-1"}, dev)
    assert not native_cache.gpu_visible({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, dev)  # (a scheduler's none)
    assert native_cache.gpu_visible({"CUDA_VISIBLE_DEVICES": "GPU-3bf43ea9,1"}, dev)
    (dev / "nvidia0").unlink()
    (dev / "kfd").touch()  # ROCm
    assert native_cache.gpu_visible({}, dev)


def test_run_launcher_skips_the_build_on_a_gpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """With any build bound to fail, a GPU host's launcher neither builds nor turns the route off."""
    from ddpdoctor import native_cache
    from ddpdoctor.cli.run_cmd import prepare_native

    monkeypatch.setenv(native_hook.FAULT_ENV, "compile")  # any build attempt would fail and say so
    monkeypatch.setattr(native_cache, "gpu_visible", lambda environ=None, dev=None: True)
    env: dict[str, str] = {}
    prepare_native(env, "ddpdoctor run", gpu_skips=True)
    assert env == {}  # nothing built and nothing told to the ranks (a build would have failed and said so)


def _half_grads(rank: int, dtype: torch.dtype, instrumented: bool) -> list[torch.Tensor]:
    """The gradients of 3 steps of a model in ``dtype`` (every step's, all-reduced)."""
    ddp = DDP(make_model().to(dtype), bucket_cap_mb=BUCKET_CAP_MB)
    monitor = ddpdoctor.instrument(ddp, sink=MemorySink()) if instrumented else None
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    grads: list[torch.Tensor] = []
    for _ in range(3):
        x = torch.randn(8, 32, generator=g).to(dtype)
        ddp(x).float().pow(2).mean().backward()
        grads += [p.grad.clone() for p in ddp.parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad()
    if monitor is not None:
        monitor.close()
    return grads


def _half_same(rank: int) -> dict[str, list[bool]]:
    """Per half-precision dtype, whether each gradient is the same instrumented as plain."""
    return {
        str(dtype): [
            torch.equal(a, b)
            for a, b in zip(_half_grads(rank, dtype, False), _half_grads(rank, dtype, True), strict=True)
        ]
        for dtype in (torch.bfloat16, torch.float16)
    }


def three_rank_checks(rank: int, world_size: int) -> dict[str, Any]:
    plain = train(DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB), rank)
    losses, summary, _ = _instrumented(rank, {})
    half = _half_same(rank)
    os.environ[native_hook.ENV] = "0"
    python_losses, python_summary, _ = _instrumented(rank, {})
    python_half = _half_same(rank)
    del os.environ[native_hook.ENV]
    return {
        "plain": plain,
        "native": (losses, summary, half),
        "python": (python_losses, python_summary, python_half),
    }


def test_three_ranks_train_identically(native_built: Path) -> None:
    """1/3 is not exact in floating point: both routes scale as DDP's own no-hook path does (a
    multiply by the reciprocal; a divide by 3 differs in the last bit for a third of the values).
    In bfloat16 and float16 too: the reciprocal is passed as DDP passes it (a wrapped double
    scalar), not rounded to the bucket's dtype first (C++'s Scalar overload of ``mul_`` does that,
    and changed a third of the gradients' last bits)."""
    for out in run_ranks(three_rank_checks, 3, timeout=240):
        for route in ("native", "python"):
            losses, summary, half = out[route]
            assert losses == out["plain"], route
            assert summary["timing"] == [route]
            _check_marks(summary, len(summary["steps"][-1][0]))
            for dtype, same in half.items():
                assert same and all(same), (route, dtype)


def test_same_requires_grad_reads_every_flag(native_built: Path) -> None:
    """The per-forward requires_grad check in one call: equal only when every flag is the byte
    given for it; a length that differs or an item that is not a tensor is "not the same" (the
    checks then read the flags from Python)."""
    same = native_hook._import(native_built.stem, native_built).same_requires_grad
    params = [torch.nn.Parameter(torch.zeros(2)), torch.zeros(3), torch.nn.Parameter(torch.ones(1))]
    assert same(params, bytes([1, 0, 1]))
    params[2].requires_grad_(False)
    assert not same(params, bytes([1, 0, 1])) and same(params, bytes([1, 0, 0]))
    assert not same(params, bytes([1, 0])) and not same(params[:2], bytes([1, 0, 0]))
    assert not same([*params[:2], "w"], bytes([1, 0, 0]))
    assert same([], b"")


def _last_backward_checks(rank: int, world_size: int) -> dict[str, Any]:
    """A step whose backward is the last thing before ``close``, and one before a user hook is
    registered: no optimizer step drains the ring after them."""
    out: dict[str, Any] = {}
    x, y = torch.randn(8, 32), torch.randn(8, 4)
    for case in ("close", "user_hook"):
        sink = MemorySink()
        ddp = DDP(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
        monitor = ddpdoctor.instrument(ddp, sink=sink)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for _ in range(2):
            ((ddp(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()  # no optimizer step after this backward
        if case == "user_hook":
            ddp.register_comm_hook([], sum_hook)
            ((ddp(x) - y) ** 2).mean().backward()
        monitor.close()
        out[case] = _summary(sink)
    return out


def test_a_backward_without_an_optimizer_step_keeps_its_marks(native_built: Path) -> None:
    for r in run_ranks(_last_backward_checks, 2, timeout=240):
        for case in ("close", "user_hook"):
            summary = r[case]
            assert summary["timing"] == ["native"], case
            steps = summary["steps"]
            _check_marks(summary, len(steps[-1][0]), steps=3 if case == "close" else 4)  # the last ones too
            assert len(steps[-1][0]) >= 3, case


def test_tensor_values_equal_the_python_fingerprint(native_built: Path) -> None:
    """The fingerprint in one C++ call gives the bits Python's gives, bit for bit, and its norms
    and sums to float32 rounding, for every kind of tensor a model holds: ranks are compared by
    the bits, and a rank whose extension did not build fingerprints in Python. (A float tensor is
    read once in C++ and summed in double; ATen sums in float32, in an order of its own.)"""
    from bench.fingerprint import agree
    from ddpdoctor.runtime.checks.fingerprints import Fingerprinter, float_values, fold_bits, tensor_bits

    values = native_hook._import(native_built.stem, native_built).tensor_values
    torch.manual_seed(0)
    tensors = [
        torch.nn.Parameter(torch.randn(64, 32)),
        torch.randn(64, 32).t(),  # not contiguous
        torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        torch.randn(4, 1).expand(4, 6),  # overlapping: copied
        torch.randn(10, 10)[::2, 1:],  # a strided slice: copied
        torch.randn(1000).half(),
        torch.randn(300).bfloat16(),
        torch.randn(77, dtype=torch.float64) * 1e6,
        torch.full((5,), -1.0, dtype=torch.float64),  # words that wrap past 2**64
        torch.arange(7),  # a BatchNorm's num_batches_tracked
        torch.tensor([True, False, True]),
        torch.randint(-30000, 30000, (9,), dtype=torch.int16),
        torch.randint(0, 255, (9,), dtype=torch.uint8),
        torch.zeros(0),
        torch.randn(3, dtype=torch.complex64),
        torch.eye(3).to_sparse(),
        torch.tensor(2.5),
    ]
    bits = [fold_bits(b) for b in tensor_bits(tensors).tolist()]
    assert all(0 <= b < 2**53 for b in bits)
    assert len(set(bits[:13])) == 13  # distinct tensors, distinct bits
    for sums_from in (0, 5, len(tensors)):
        row = float_values(tensors, sums_from).tolist()
        expected = (row[: len(tensors)], row[len(tensors) :], bits)
        assert len(expected[1]) == len(tensors) - sums_from
        assert agree(tensors, sums_from, values(tensors, sums_from), expected)
        got: list[Any] = []
        for native in (values, None):  # the extension's, then the Python route
            Fingerprinter(lambda *delivered, got=got: got.append(delivered), native).take(tensors, sums_from, "m")
        assert [g[0] for g in got] == ["m", "m"]
        assert agree(tensors, sums_from, got[0][1:], expected) and got[1][1:] == expected
    # a float tensor's norm and sum are those of its values, to float32 rounding, from the C++ pass
    t = torch.tensor([3.0, 4.0, -1.0, 0.5], dtype=torch.bfloat16)
    (norm,), (total,), _ = values([t], 0)
    assert math.isclose(norm, math.sqrt(26.25), rel_tol=1e-6) and total == 6.5
    big = torch.randn(30_001)  # the C++ pass across its blocks, with a tail
    norm, total = values([big], 0)[0][0], values([big], 0)[1][0]
    assert math.isclose(norm, float(big.double().norm()), rel_tol=1e-6)
    assert abs(total - float(big.double().sum())) <= 1e-6 * float(big.double().abs().sum())
    assert values([], 0) == ([], [], [])


def test_optimizer_stamps_set_the_common_case_as_the_python_rule_does(native_built: Path) -> None:
    """``take_into``: one start and one end on a step that has buckets and no optimizer marks are
    set on it (what ``StepRecorder.optimizer_start``/``optimizer_end`` do with them); anything
    else comes back as ``take`` gives it, for the Python rule."""
    from ddpdoctor.runtime.step.recorder import OpenStep

    module = native_hook._import(native_built.stem, native_built)
    offset = 1_000

    def stamped(*starts: bool) -> Any:
        stamps = module.OptimizerStamps()
        for start in starts:
            (stamps.pre if start else stamps.post)(None, (), {})
        return stamps

    step = OpenStep(0, 0)
    step.ready = [5]
    before = module.clock_ns() + offset
    stamps = stamped(True, False)
    after = module.clock_ns() + offset
    assert stamps.take_into(step, offset) is None
    assert before <= step.opt_start <= step.opt_end <= after
    assert stamps.take_into(step, offset) is None  # nothing left
    packed = OpenStep(0, 0)  # its buckets' marks packed (the routine forward's drain): it has buckets
    packed.packed = bytes(24)
    assert stamped(True, False).take_into(packed, offset) is None and packed.opt_end is not None

    cases: dict[str, tuple[Any, tuple[bool, ...]]] = {
        "no buckets yet": (OpenStep(0, 0), (True, False)),
        "no step": (None, (True, False)),
        "an end alone (a closure)": (step, (False,)),
        "two optimizer steps": (step, (True, False, True, False)),
    }
    marked = OpenStep(0, 0)
    marked.ready, marked.opt_start = [5], 7
    cases["optimizer marks set already"] = (marked, (True, False))
    for case, (target, starts) in cases.items():
        kept = (getattr(target, "opt_start", None), getattr(target, "opt_end", None))
        events = stamped(*starts).take_into(target, offset)
        assert [start for start, _ in events] == list(starts), case
        assert all(isinstance(at, int) and at > offset for _, at in events), case
        assert (getattr(target, "opt_start", None), getattr(target, "opt_end", None)) == kept, case


def test_step_opener_builds_the_step_python_builds(native_built: Path) -> None:
    """``step_opener(OpenStep)``: every slot of its step equals OpenStep(index, t0)'s (the clocks
    read between two reads of Python's, shifted by the offset), fresh lists each time, and
    ``synced`` sets the synchronizing forward's start; a class it does not know is refused."""
    from ddpdoctor.runtime.step.recorder import OpenStep

    module = native_hook._import(native_built.stem, native_built)
    opener = module.step_opener(OpenStep)
    offset = 7_000
    for synced in (False, True):
        mono0, wall0 = time.perf_counter_ns(), time.time_ns()
        step = opener(12, 345, offset, synced)
        mono1, wall1 = time.perf_counter_ns(), time.time_ns()
        python = OpenStep(12, 345)
        if synced:
            python.fwd_start, python.synced_forward = 345, True
        assert type(step) is OpenStep
        assert mono0 + offset <= step.t0_mono_ns <= mono1 + offset
        assert wall0 + offset <= step.t0_wall_ns <= wall1 + offset
        python.t0_mono_ns, python.t0_wall_ns = step.t0_mono_ns, step.t0_wall_ns
        for name in OpenStep.__slots__:
            assert getattr(step, name) == getattr(python, name), name
            assert type(getattr(step, name)) is type(getattr(python, name)), name
    other = opener(13, 346, 0, True)
    assert other.ready is not step.ready and other.bcast is not step.bcast and other.done_seen is not step.done_seen
    other.ready.append(1)
    assert step.ready == [] and other.marks()[0] == 346
    with pytest.raises(TypeError):
        opener(1, 2, 3)

    class Other:
        __slots__ = ("index",)

    class Renamed:  # as many slots as OpenStep, one of another name
        __slots__ = (*OpenStep.__slots__[:-1], "elsewhere")

    for cls in (Other, Renamed):
        with pytest.raises(TypeError):
            module.step_opener(cls)

"""``torch.compile`` over an instrumented DDP model (dynamo's DDP optimizer): dynamo must call
the monitor's hooks as they are, not trace them into its graphs. Real 2-rank gloo DDP, compiled
plain and instrumented in each rank; the ``eager`` backend, since what is checked is dynamo's
tracing (graphs, breaks, frames), not code generation."""

from __future__ import annotations

import inspect
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor
from tests.ddp_harness import run_ranks

pytestmark = pytest.mark.torch_compat

STEPS = 5


def _ddpdoctor_code() -> list[types.CodeType]:
    """The code objects of ddpdoctor's runtime functions and methods (what dynamo may compile)."""
    import ddpdoctor.runtime as runtime

    package = str(Path(ddpdoctor.__file__).parent)
    codes = []
    for info in runtime.__path__:
        for path in sorted(Path(info).glob("*.py")):
            module = __import__(f"ddpdoctor.runtime.{path.stem}", fromlist=["_"])
            for _, obj in inspect.getmembers(module):
                members = inspect.getmembers(obj) if inspect.isclass(obj) else [("", obj)]
                for _, fn in members:
                    fn = getattr(fn, "__func__", fn)
                    code = getattr(fn, "__code__", None)
                    if code is not None and code.co_filename.startswith(package):
                        codes.append(code)
    return codes


def _train(rank: int, run_dir: str | None) -> tuple[list[float], int]:
    from torch._dynamo import reset
    from torch._dynamo.utils import counters

    reset()
    counters.clear()
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    monitor = ddpdoctor.instrument(ddp, run_dir) if run_dir is not None else None
    compiled = torch.compile(ddp, backend="eager")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank + 1)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = ((compiled(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if monitor is not None:
        monitor.close()
    return losses, sum(counters["graph_break"].values())


def _worker(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    plain, plain_breaks = _train(rank, None)
    instrumented, breaks = _train(rank, tmp)
    compiled = [
        f"{c.co_filename}:{c.co_firstlineno} {c.co_name}" for c in _ddpdoctor_code() if _debug_get_cache_entry_list(c)
    ]
    return {
        "plain": plain,
        "instrumented": instrumented,
        "plain_breaks": plain_breaks,
        "breaks": breaks,
        "compiled": compiled,
        "world": dist.get_world_size(),
    }


@pytest.fixture(scope="module")
def compiled_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    tmp = tmp_path_factory.mktemp("compiled-ddp")
    return run_ranks(_worker, args=(str(tmp),), timeout=300), tmp


def test_a_compiled_ddp_trains_identically_and_dynamo_compiles_none_of_ddpdoctor(compiled_run: Any) -> None:
    results, _ = compiled_run
    for r in results:
        assert r["instrumented"] == r["plain"]
        # dynamo ran ddpdoctor's code as it is: no frame of it compiled, and one graph break
        # more than the plain compiled model (the call of the monitor's forward pre-hook)
        assert r["compiled"] == []
        assert r["breaks"] <= r["plain_breaks"] + 1, (r["breaks"], r["plain_breaks"])


def test_a_compiled_ddp_is_still_observed(compiled_run: Any) -> None:
    _, tmp = compiled_run
    run = ddpdoctor.load_run(tmp)
    assert sorted(run.ranks) == [0, 1]
    for log in run.ranks.values():
        assert [s.step for s in log.steps] == list(range(STEPS))
        for s in log.steps:
            assert s.fwd_start_us is not None and s.fwd_end_us is not None
            assert s.b_ready_us and all(b is not None for b in s.b_ready_us)
            assert s.opt_start_us is not None
        assert [fp.step for fp in log.fingerprints if not fp.final] == [0, 1, 3]
    assert ddpdoctor.analyze(run).findings == []


_LATE_IMPORT = """
import sys
from ddpdoctor.runtime import torch_compat
assert "torch._dynamo.trace_rules" not in sys.modules
torch_compat.skip_in_dynamo()
print(torch_compat.dynamo_skip_state())
import torch._dynamo.trace_rules as rules
print(torch_compat.dynamo_skip_state())
print(rules.check_file(torch_compat.__file__).skipped, rules.check_file(__file__).skipped)
print(sum(type(f).__name__ == "_AfterDynamoRules" for f in sys.meta_path))
"""


def test_dynamo_imported_after_the_monitor_attached_still_skips_ddpdoctor(tmp_path: Path) -> None:
    """``ddpdoctor run`` attaches when DDP is built, before the script calls ``torch.compile``
    (which imports dynamo): the rule is added when dynamo's trace rules are imported."""
    import subprocess
    import sys

    script = tmp_path / "late.py"
    script.write_text(_LATE_IMPORT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    # waiting for dynamo, then done; ddpdoctor's files skipped, the script's own not; the finder gone
    assert out.stdout.split() == ["waiting", "done", "True", "False", "0"], out.stdout + out.stderr


def _compiled_backward(rank: int, monitor_dir: str | None) -> tuple[list[float], bool]:
    """DDP's Python reducer (``optimize_ddp="python_reducer"``, the one compiled autograd takes),
    compiled autograd enabled around each backward only, after the forward: the losses, and
    whether DDP took the Python reducer."""
    import torch._dynamo.config as dynamo_config
    from torch._dynamo import compiled_autograd, reset

    reset()
    enable = getattr(compiled_autograd, "_enable", None) or compiled_autograd.enable
    saved = dynamo_config.optimize_ddp
    dynamo_config.optimize_ddp = "python_reducer"
    try:
        torch.manual_seed(0)
        ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    finally:
        dynamo_config.optimize_ddp = saved
    # a check every step: each forward hooks the parameters' gradient accumulators for the sample
    monitor = ddpdoctor.instrument(ddp, monitor_dir, check_every=1) if monitor_dir is not None else None
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank + 1)
    losses = []
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        with enable(torch.compile(backend="eager")):
            loss.backward()
        opt.step()
        losses.append(loss.item())
    if monitor is not None:
        monitor.close()
    return losses, bool(getattr(ddp, "_use_python_reducer", False))


def _compiled_backward_worker(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    plain, python_reducer = _compiled_backward(rank, None)
    instrumented, _ = _compiled_backward(rank, tmp)
    return {"plain": plain, "instrumented": instrumented, "python_reducer": python_reducer}


def test_compiled_autograd_enabled_around_the_backward_trains_as_without_ddpdoctor(tmp_path: Path) -> None:
    """Compiled autograd raises on a C++ hook it cannot trace: ddpdoctor's hooks on the gradient
    accumulators (a sample's arrival stamps, added at the forward, before the backward enables it)
    stay out of its graph, and the run trains as it does without ddpdoctor."""
    results = run_ranks(_compiled_backward_worker, args=(str(tmp_path),), timeout=300)
    if not results[0]["python_reducer"]:
        pytest.skip("this torch's DDP takes no Python reducer")
    for r in results:
        assert r["instrumented"] == r["plain"]

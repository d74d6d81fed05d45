"""The runtime on real 2-rank gloo DDP: unchanged training, no added collective, hooks, safety."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ddpdoctor
from ddpdoctor.analysis.bucket_wait import arrivals
from ddpdoctor.analysis.clock_align import estimate_offsets
from ddpdoctor.cli.render_text import render
from ddpdoctor.events import Header, Layout, ProbeOff, Step
from ddpdoctor.runtime import torch_compat
from tests.ddp_harness import run_ranks
from tests.runtime_workers import DELAYS_S, core_checks, delay_checks, sampled_marks_run

pytestmark = pytest.mark.torch_compat


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    tmp = tmp_path_factory.mktemp("core")
    return run_ranks(core_checks, 2, args=(str(tmp),), timeout=240), tmp


def test_losses_bit_identical_with_and_without_instrument(core: Any) -> None:
    results, _ = core
    for r in results:
        assert len(r["plain"]) == 6
        assert r["instr"] == r["plain"]  # exact float equality, every step
        assert r["pyhook"] == r["plain"]
        assert r["instr_warnings"] == []


def test_no_collective_added_to_the_training_step(core: Any) -> None:
    results, tmp = core
    run = ddpdoctor.load_run(tmp / "instr")
    for r in results:
        instr, plain, pyhook = r["instr_counts"], r["plain_counts"], r["pyhook_counts"]
        # no torch.distributed call at all beyond DDP's own (its buffer broadcasts) ...
        assert {k: v for k, v in instr.items() if not k.startswith("pg.")} == plain == {"_broadcast_coalesced": 6}
        # ... and at the process group, one all-reduce per bucket per step: the one DDP itself does
        # (natively in C++ without a hook, through the same method with torch's Python allreduce hook)
        buckets_logged = sum(len(s.b_ready_us) for s in run.ranks[r["rank"]].steps)
        # (ddpdoctor's native comm hook calls it from C++, unseen here, as DDP does without a hook)
        native = run.ranks[r["rank"]].header.timing == "native"
        expected = {} if native else {"pg.allreduce": buckets_logged}
        assert {k: v for k, v in instr.items() if k.startswith("pg.")} == expected
        assert pyhook["pg.allreduce"] == pyhook["all_reduce"] == buckets_logged > 6
        assert "cuda.synchronize" not in instr


def test_log_records_steps_buckets_layout_and_header(core: Any) -> None:
    _, tmp = core
    run = ddpdoctor.load_run(tmp / "instr")
    assert sorted(run.ranks) == [0, 1]
    files = sorted(tmp.rglob("rank-*.jsonl"))
    assert len(files) >= 2
    for f in files:  # every log starts with its header (the process sampler waits for it)
        with f.open() as lines:
            assert json.loads(lines.readline())["kind"] == "header", f
    for rank, log in run.ranks.items():
        h = log.header
        assert isinstance(h, Header) and h.rank == rank and h.world_size == 2 and h.backend == "gloo"
        assert h.ddp_options["broadcast_buffers"] is True and h.ddp_options["forward_sync_buffers"] is True
        assert h.ddp_options["find_unused_parameters"] is False
        assert abs(h.ddp_options["bucket_cap_mb"] - 0.01) < 1e-4
        assert {p.name for p in h.params} >= {"body.0.weight", "head.bias"} and all(p.requires_grad for p in h.params)
        assert {b.name for b in h.buffers} == {
            "body.1.running_mean",
            "body.1.running_var",
            "body.1.num_batches_tracked",
        }
        assert all(b.broadcast for b in h.buffers)
        assert [s.step for s in log.steps] == list(range(6))
        assert [s.micro for s in log.steps] == [0, 0, 1, 0, 0, 1]
        bn_bytes = sum(b.bytes for b in h.buffers)
        for s in log.steps:
            assert isinstance(s, Step)
            n = len(s.b_ready_us)
            # DDP reduces the first iteration in one bucket, then rebuilds in autograd order
            assert n >= (3 if s.step else 1) and len(s.b_launch_us) == len(s.b_done_us) == len(s.b_bytes) == n
            for ready, launch, done in zip(s.b_ready_us, s.b_launch_us, s.b_done_us, strict=True):
                assert s.fwd_end_us <= ready <= launch <= done
            assert s.bwd_end_us is not None and max(s.b_ready_us) <= s.bwd_end_us
            assert s.sync_end_us == max(s.b_done_us)
            assert s.fwd_us is not None and s.fwd_us > 0
            assert s.bcast_bytes == bn_bytes and s.bcast_us is not None and s.bcast_us > 0
            assert s.opt_start_us is not None and s.sync_end_us <= s.opt_start_us <= s.opt_end_us
            if s.micro:
                assert s.fwd_start_us > 0  # the micro-step came first
        assert all(s.end_us is not None and s.end_us >= s.opt_end_us for s in log.steps[:-1])
        assert sum(s.b_bytes[0] + sum(s.b_bytes[1:]) for s in log.steps[:1]) > 0
        layouts = log.layouts
        assert [lay.reason for lay in layouts][:2] == ["initial", "rebuilt"]
        assert isinstance(layouts[0], Layout)
        names = [p for b in layouts[-1].buckets for p in b.params]
        assert sorted(names) == sorted(p.name for p in h.params)
        assert log.procs and log.procs[0].rss_bytes > 0
        assert log.end is not None and log.end.reason == "close" and log.end.steps == 6
        assert log.corrupt_lines == 0


def test_user_hook_registered_before_instrument_still_applies(core: Any) -> None:
    results, tmp = core
    for r in results:
        assert r["fp16_instr"] == r["fp16_plain"]
        assert r["fp16_plain"] != r["plain"]  # the hook visibly changes training
    run = ddpdoctor.load_run(tmp / "fp16")
    assert run.ranks[0].header.ddp_options["comm_hook"] == "fp16_compress_hook"
    assert all(len(s.b_done_us) >= (3 if s.step else 1) for s in run.ranks[0].steps)  # and it is timed


def test_user_hook_registered_after_instrument_still_applies(core: Any) -> None:
    results, tmp = core
    for r in results:
        assert r["sum_instr"] == r["sum_plain"]
        assert r["sum_plain"][1:] != r["plain"][1:]
        assert r["sum_hook_calls"][0] == r["sum_hook_calls"][1] > 0
        assert "only be called once" in r["second_register"]  # DDP's rule still holds
    run = ddpdoctor.load_run(tmp / "custom")
    assert all(len(s.b_done_us) >= (3 if s.step else 1) for s in run.ranks[1].steps)


def test_a_hook_registered_after_instrument_is_the_one_the_report_names(core: Any) -> None:
    _, tmp = core
    # the header was written at attach, before the hook: the layout records name it
    run = ddpdoctor.load_run(tmp / "custom")
    for log in run.ranks.values():
        assert log.header.ddp_options.get("comm_hook") is None
        assert [lay.comm_hook for lay in log.layouts] == ["sum_hook"] * len(log.layouts)
    report = ddpdoctor.analyze(run)
    assert report.run["ddp_options"]["comm_hook"] == "sum_hook"
    assert "comm_hook=sum_hook" in render(report)
    cli = subprocess.run(
        [sys.executable, "-m", "ddpdoctor", "report", str(tmp / "custom"), "--format", "json"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert json.loads(cli.stdout)["run"]["ddp_options"]["comm_hook"] == "sum_hook", cli.stderr

    # registered after three steps: a layout record with the same buckets says so from step 3 on
    late = ddpdoctor.load_run(tmp / "late_hook")
    for log in late.ranks.values():
        assert [(lay.reason, lay.comm_hook) for lay in log.layouts][-1] == ("comm_hook", "sum_hook")
        assert log.layouts[-1].step == 3 and all(lay.comm_hook is None for lay in log.layouts[:-1])
    assert ddpdoctor.analyze(late).run["ddp_options"]["comm_hook"] == "sum_hook"

    # without a hook: DDP's default, said as such
    plain = ddpdoctor.analyze(ddpdoctor.load_run(tmp / "instr"))
    assert plain.run["ddp_options"]["comm_hook"] is None
    assert "comm_hook=default" in render(plain)
    # a hook registered before instrument: in the header and in the layouts alike
    fp16 = ddpdoctor.load_run(tmp / "fp16")
    assert {lay.comm_hook for lay in fp16.ranks[0].layouts} == {"fp16_compress_hook"}
    assert ddpdoctor.analyze(fp16).run["ddp_options"]["comm_hook"] == "fp16_compress_hook"


def test_failing_probe_warns_once_switches_off_and_training_finishes(core: Any) -> None:
    results, tmp = core
    run = ddpdoctor.load_run(tmp / "probe")
    for r in results:
        assert r["probe"] == r["plain"]
        assert len(r["probe_warnings"]) == 1
        category, message = r["probe_warnings"][0]
        assert category == "ProbeDisabledWarning" and "'buckets'" in message and "injected failure" in message
        log = run.ranks[r["rank"]]
        assert [p.probe for p in log.probes_off] == ["buckets"]
        assert isinstance(log.probes_off[0], ProbeOff)
        assert len(log.steps) == 6 and all(s.fwd_us is not None and not s.b_ready_us for s in log.steps)


def test_unwritable_run_dir_warns_and_training_finishes(core: Any) -> None:
    results, _ = core
    for r in results:
        assert r["unwritable"] == r["plain"]
        assert r["unwritable_path"] is None
        assert [c for c, _ in r["unwritable_warnings"]] == ["LogWriteWarning"]
        assert "not-a-dir" in r["unwritable_warnings"][0][1]


def test_ranks_agree_on_a_default_run_dir(core: Any) -> None:
    results, _ = core
    dirs = {r["default_run_dir"] for r in results}
    assert len(dirs) == 1
    run_dir = Path(dirs.pop())
    assert run_dir.parent.name == "ddpdoctor-runs"
    assert sorted(p.name for p in run_dir.iterdir()) == ["rank-00000.jsonl", "rank-00001.jsonl"]


@pytest.mark.timing
def test_timings_measure_real_delays(tmp_path: Path) -> None:
    run_ranks(delay_checks, 2, args=(str(tmp_path),), timeout=180)
    run = ddpdoctor.load_run(tmp_path / "delay")
    report = ddpdoctor.analyze(run)
    fast, slow = (r["medians_ms"] for r in report.ranks)
    seen = f"fast rank {fast}, slow rank {slow}"
    # differences between the ranks, not absolute times: load on the machine slows both ranks alike
    forward_s, backward_s = DELAYS_S
    assert slow["forward"] - fast["forward"] >= 0.7 * forward_s * 1e3, seen
    assert slow["backward"] - fast["backward"] >= 0.7 * backward_s * 1e3, seen
    # the fast rank blocks in the all-reduce for the slow one, the slow rank does not wait
    assert fast["bucket_wait"] >= 0.7 * backward_s * 1e3, seen
    assert slow["bucket_wait"] < fast["bucket_wait"] / 3, seen
    # the collective evens out both ranks' step times: over the same steps (the first left out,
    # it holds the ranks' start-up skew) they take the same time. Totals, not medians: one step
    # stretched by load on one rank moves a median of four but not the sum the ranks share
    span = {
        rank: {s.step: s.end_us for s in log.steps if s.step >= 1 and s.end_us is not None}
        for rank, log in run.ranks.items()
    }
    common = sorted(set(span[0]) & set(span[1]))
    assert len(common) >= 3, span
    total = [sum(span[r][n] for n in common) for r in (0, 1)]
    assert abs(total[0] - total[1]) < 0.1 * max(total), (total, seen)


@pytest.mark.timing
def test_steps_between_samples_keep_their_phases_and_the_straggler_from_two_bucket_marks(tmp_path: Path) -> None:
    """The CUDA default (every bucket marked at the sampled steps only), on real gloo DDP: the
    mark queued from inside the backward-end callback runs after DDP's finalization, so the fast
    rank's exposed communication holds its wait for the slow one, and the report names it."""
    results = run_ranks(sampled_marks_run, 2, args=(str(tmp_path),), timeout=180)
    assert [r["timing"] for r in results] == ["python", "python"]
    run = ddpdoctor.load_run(tmp_path / "sampled")
    fast = run.ranks[0].steps
    assert [s.step for s in fast] == list(range(12))
    # steps 10 and 11 ran after the backward-end probe was switched off: every bucket marked
    assert all(s.per_bucket() and None not in s.b_ready_us and None not in s.b_done_us for s in fast[10:]), fast[10:]
    fast = fast[:10]
    for s in fast[1:]:  # (step 0: one bucket, before DDP rebuilds them in gradient order)
        n = len(s.b_bytes)
        assert n >= 3 and len(s.b_ready_us) == n, s
        if s.step in (1, 3, 7):
            assert s.per_bucket() and None not in s.b_ready_us and len(s.b_done_us) == n, s
            continue
        assert s.clock == "cuda" and not s.per_bucket() and s.b_done_us == [] and s.b_launch_us == s.b_ready_us, s
        assert s.b_ready_us[0] is not None and s.b_ready_us[-1] is not None and None in s.b_ready_us, s
        assert s.sync_end_us is not None and s.bwd_end_us is not None
        # DDP's wait for the slow rank (0.12 s) lies between backward's end and the sync mark
        assert s.sync_end_us - s.bwd_end_us >= 0.7 * 0.12e6, s
    # every step is compared across the ranks, the partial ones at their first and last bucket
    steps_by_rank = {r: log.steps for r, log in run.ranks.items()}
    got = arrivals(steps_by_rank, estimate_offsets(steps_by_rank))
    assert [sa.step for sa in got] == list(range(12)) and sum(not sa.per_bucket for sa in got) == 6
    # the fast rank waits for the slow one at every step, the slow one for no one. One step may
    # fall short on a loaded host (the fast rank descheduled for tens of ms inside its own
    # backward is late to the all-reduce itself, and really waits less): all steps but one
    seen = [(sa.step, sa.per_bucket, sa.wait_us) for sa in got]
    short = [sa.step for sa in got if sa.step > 0 and sa.wait_us[0] < 0.7 * 0.12e6]
    assert len(short) <= 1, seen
    assert sorted(sa.wait_us[0] for sa in got)[len(got) // 2] >= 0.9 * 0.12e6, seen
    assert all(sa.wait_us[1] < 0.3 * 0.12e6 for sa in got if sa.step > 0), seen  # (step 0: start-up skew)
    found = ddpdoctor.analyze(run).findings
    straggler = [f for f in found if f.code == "straggler"]
    assert straggler and straggler[0].ranks == [1], found


def test_uneven_inputs_under_join_train_identically_and_raise_no_false_alarm(core: Any) -> None:
    results, tmp = core
    for r in results:
        plain, instr = r["join"]
        assert instr == plain, r["rank"]
    run = ddpdoctor.load_run(tmp / "join")
    assert {rank: len(log.steps) for rank, log in run.ranks.items()} == {0: 5, 1: 3}
    # the ranks end at different steps; Join synced the final model, so the replicas agree there
    finals = {rank: [f.step for f in log.fingerprints if f.final] for rank, log in run.ranks.items()}
    assert finals == {0: [5], 1: [3]}
    found = ddpdoctor.analyze(run).findings
    assert not [f for f in found if f.code in ("replica-divergence", "buffer-divergence")], found
    assert not [f for f in found if f.severity == "error"], found
    for r in results:  # the divisor DDP takes under divide_by_initial_world_size=False is honoured
        plain, instr = r["join_rescaled"]
        assert instr == plain, r["rank"]
        assert r["join_rescaled_said"] == []


def test_an_optimizer_step_with_a_closure_is_timed_after_the_backward(core: Any) -> None:
    results, tmp = core
    for r in results:
        plain, instr = r["closure"]
        assert instr == plain
    run = ddpdoctor.load_run(tmp / "closure")
    for log in run.ranks.values():
        assert len(log.steps) == 5
        for s in log.steps:
            # the forward and backward ran inside optimizer.step(): the optimizer's own work is
            # what follows them, and the step's phases do not overlap
            assert s.opt_start_us is not None and s.opt_end_us is not None, s
            assert s.sync_end_us is not None and s.bwd_end_us is not None
            assert max(s.sync_end_us, s.bwd_end_us) <= s.opt_start_us <= s.opt_end_us, s
            assert s.end_us is None or s.opt_end_us <= s.end_us
    medians = ddpdoctor.analyze(run).ranks[0]["medians_ms"]
    assert medians["optimizer"] is not None and medians["optimizer"] >= 0


def test_other_ddp_options_train_identically_and_are_recorded(core: Any) -> None:
    results, tmp = core
    for r in results:
        for name, (plain, instr, steps) in r["variants"].items():
            assert instr == plain, name
            assert steps == 6, name
    for name, key, value in [
        ("find_unused", "find_unused_parameters", True),
        ("static_graph", "static_graph", True),
        ("bucket_view", "gradient_as_bucket_view", True),
    ]:
        options = ddpdoctor.load_run(tmp / f"variant-{name}").ranks[0].header.ddp_options
        assert options[key] is value, name
    # both spellings of the same switch, where this torch has the new one (2.13+)
    assert ("forward_sync_off" in results[0]["variants"]) is torch_compat.constructor_accepts("forward_sync_buffers")
    for name in sorted(results[0]["variants"].keys() & {"no_buffer_sync", "forward_sync_off"}):
        log = ddpdoctor.load_run(tmp / f"variant-{name}").ranks[0]
        assert log.header.ddp_options["broadcast_buffers"] is False
        assert log.header.ddp_options["forward_sync_buffers"] is False
        assert not any(b.broadcast for b in log.header.buffers)
        assert all(s.bcast_us is None and s.bcast_bytes == 0 for s in log.steps)


def test_rewrap_equals_rebuilding_ddp_by_hand(core: Any) -> None:
    results, tmp = core
    for r in results:
        assert r["rewrap"]["losses"] == r["rewrap_by_hand"]["losses"]  # same options, same hook, same optimizer
        assert r["rewrap"]["type"] == "DistributedDataParallel" and r["rewrap"]["find_unused"] is True
        assert r["rewrap"]["cap"] == r["rewrap_by_hand"]["cap"]
        assert r["rewrap_hook_calls"][0] == r["rewrap_hook_calls"][1] > 6  # the user's hook survived the rebuild
        assert r["check_replicas"] == []
    log = ddpdoctor.load_run(tmp / "rewrap").ranks[0]
    assert [h.reason for h in log.headers] == ["attach", "rewrap"] and log.headers[1].first_step == 3
    assert [p.reduced for p in log.headers[1].params if p.name.startswith("head.")] == [False, False]
    assert [s.step for s in log.steps] == list(range(6))
    assert not log.findings  # the freeze was followed by a rewrap: nothing stale

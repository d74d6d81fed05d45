"""Bucket what-if validation: predicted vs measured step time over bucket_cap_mb, on real 2-rank gloo runs.

usage: python bench/bucket_whatif.py [--steps 20] [--rounds 3] [--base 25] [--json FILE]
                                     [--keep DIR | --reuse DIR [DIR ...]]

Four model shapes (``mlp-1mib``: about 1 MiB of gradients in 18 tensors, 8 buckets at 0.01 MiB;
``many-small``: 48 layers, a bucket each at 0.01 MiB; ``few-large``: three 9 MiB weights;
``mixed``: two large layers and 24 small ones) are trained on two gloo ranks on CPU with each
``bucket_cap_mb`` in {0.01, 0.1, 1, 5, 25, 100}, instrumented by ddpdoctor (sampled checks every
3 steps: the per-parameter gradient-ready times). All runs share one process group and run one
after another, in ``--rounds`` rounds that visit the caps in a rotated order (the machine's speed
drifts). A run's measured step time is the median over its timed steps of the slower rank's wall
time per step (``time.perf_counter`` around the whole step).

The simulator sees only the logs of the base runs of each model: ``--base`` (default 25) and the
smallest cap, 0.01 MiB (a latency-bound layout). Each round's base run predicts every cap, set
against the same round's measured step: the prediction for cap c is the base run's measured step
times predicted(c) / predicted(base), prediction against prediction as the advice uses it. It
prints per (model, cap, round) predicted and measured, the median error from each base, the
noise (how far apart caps with the same layout measured in one round), and what the report says
from each model's first base run: the cap it recommends, with the measured step there, or its
verdict on why it names none. ``--keep DIR`` keeps the logs and the measured times; ``--reuse DIR
[DIR ...]`` predicts again from them (no training) and, given several, pools their rounds: per
(base, model, cap) the median over rounds of predicted and of measured step against the base's.

Measured on 2026-12-06 on a shared 2-core CPU machine (load average 17 to 18 from other work),
``--steps 15 --rounds 3``: median error 25.2% from 0.01 MiB and 22.4% from 25 MiB over 60 (model,
cap, round) each, with caps of the same layout 20.7% apart in one round (median; max 184%). No cap
was recommended from the eight base runs of round 0: four saved less than 5% in three of four
replayed steps, four had buckets of one size (or within 1.4x) and gave a range instead, e.g.
``many-small`` from 0.01 MiB: "every all-reduce had one size (0.251 MiB) ... bucket_cap_mb=1 would
change the step by between -14.3 and +4.9 ms".
Pooled with four earlier runs (13 rounds, load average 0 to 23): the replay of a base run's own
layout within 6.5% of its measured step (median; the model before: 14.7%), each cap against its
base within 11.8% (before: 14.7%, max 369.5% against 76.0% now). BENCHMARKS.md has the table.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import free_port, init_gloo

CAPS = (0.01, 0.1, 1.0, 5.0, 25.0, 100.0)
MODELS = ("mlp-1mib", "many-small", "few-large", "mixed")


def build(name: str) -> tuple[object, object]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "mlp-1mib":  # ~1 MiB of gradients in 18 tensors: 8 buckets at bucket_cap_mb=0.01
        return nn.Sequential(
            nn.Linear(256, 180), *[m for _ in range(7) for m in (nn.Linear(180, 180), nn.ReLU())], nn.Linear(180, 4)
        ), torch.randn(32, 256)
    if name == "many-small":
        layers: list[nn.Module] = []
        for _ in range(48):
            layers += [nn.Linear(256, 256), nn.ReLU()]
        return nn.Sequential(*layers), torch.randn(64, 256)
    if name == "few-large":
        return nn.Sequential(
            nn.Linear(1536, 1536), nn.ReLU(), nn.Linear(1536, 1536), nn.ReLU(), nn.Linear(1536, 1536)
        ), torch.randn(32, 1536)
    small: list[nn.Module] = []
    for _ in range(24):
        small += [nn.Linear(128, 128), nn.ReLU()]
    return nn.Sequential(nn.Linear(4096, 1024), nn.ReLU(), nn.Linear(1024, 128), nn.ReLU(), *small), torch.randn(
        32, 4096
    )


def worker(rank: int, world: int, port: int, out: str, steps: int, rounds: int, result_q: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpdoctor

    init_gloo(rank, world, port)
    results: dict[tuple[str, float], list[float]] = {}
    for rnd in range(rounds):
        for model_name in MODELS:
            for cap in CAPS[rnd % len(CAPS) :] + CAPS[: rnd % len(CAPS)]:
                net, x = build(model_name)
                ddp = DDP(net, bucket_cap_mb=cap)
                opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
                times = []
                with ddpdoctor.instrument(ddp, run_dir=Path(out) / f"{model_name}-{cap:g}-r{rnd}", check_every=3):
                    for i in range(steps + 5):
                        t = time.perf_counter()
                        loss = ddp(x).square().mean()
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
                        if i >= 5:
                            times.append(time.perf_counter() - t)
                per_step = torch.tensor(times)
                dist.all_reduce(per_step, op=dist.ReduceOp.MAX)  # outside the timed steps
                results.setdefault((model_name, cap), []).append(statistics.median(per_step.tolist()) * 1000.0)
                del ddp, opt
    if rank == 0:
        result_q.put(results)
    dist.barrier()
    os._exit(0)


def _advice(run: Any) -> str:
    """What the report says about the bucket cap of one run: the bucket-size finding's title, or
    the bucket part of exposed-communication's advice, or that it says nothing."""
    from ddpdoctor.analysis.diagnose import diagnose

    said = []
    for f in diagnose(run):
        if f.code == "bucket-size":
            said.append(f"bucket-size: {f.title}")
        elif f.code == "exposed-communication" and "bucket_cap_mb" in f.detail:
            said.append("exposed-communication: " + f.detail[f.detail.find("Predicted step") :])
    return " | ".join(said) or "nothing about the bucket cap"


def _measure(out: str, steps: int, rounds: int) -> dict[tuple[str, float], list[float]]:
    """Train every (model, cap) on two gloo ranks; the measured step time of each per round (ms)."""
    import torch.multiprocessing as mp

    Path(out).mkdir(parents=True, exist_ok=True)
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, port, out, steps, rounds, queue), daemon=True) for r in range(2)]
    try:
        for p in procs:
            p.start()
        measured: dict[tuple[str, float], list[float]] = queue.get(timeout=3600)
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return measured


def _load_measured(path: Path) -> dict[tuple[str, float], list[float]]:
    """``measured.json``: per (model, cap) the measured step per round (an older file kept only the median)."""
    raw = json.loads(path.read_text())
    return {(m, float(c)): (v if isinstance(v, list) else [v]) for m, c, v in raw}


def _predictions(
    out: str, base: float, rounds: int, measured: dict[tuple[str, float], list[float]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per (model, cap, round): the step predicted from that round's base run against the one measured
    in the same round; and per model what the report advised from the base run."""
    from ddpdoctor.analysis.from_run import what_if_run
    from ddpdoctor.runlog import load_run

    rows, picks = [], {}
    for model_name in MODELS:
        for rnd in range(rounds):
            run = load_run(Path(out) / f"{model_name}-{base:g}-r{rnd}")
            w = what_if_run(run, caps_mb=CAPS)
            base_ms = measured[(model_name, base)][min(rnd, len(measured[(model_name, base)]) - 1)]
            if w is None:
                print(f"{model_name} from {base:g} MiB, round {rnd}: no prediction (not enough samples)")
                continue
            by_cap = {round(c.cap_mb, 3): c for c in w.candidates}
            for cap in CAPS:
                per_round = measured[(model_name, cap)]
                meas = per_round[min(rnd, len(per_round) - 1)]
                # prediction against prediction, in the base run's measured ms: what the advice uses
                pred = base_ms * by_cap[cap].step_ms / w.current.step_ms
                rows.append(
                    {
                        "base": base,
                        "model": model_name,
                        "round": rnd,
                        "bucket_cap_mb": cap,
                        "buckets": by_cap[cap].buckets,
                        "predicted_ms": round(pred, 2),
                        "measured_ms": round(meas, 2),
                        "error_pct": round(100 * abs(pred - meas) / meas, 1),
                    }
                )
            if rnd == 0:
                medians = {c: statistics.median(measured[(model_name, c)]) for c in CAPS}
                rec = w.recommended.cap_mb if w.recommended else None
                picks[f"{model_name} from {base:g}"] = {
                    "advice": _advice(run),
                    "verdict": w.verdict,
                    "recommended": rec,
                    "measured_base_ms": round(medians[base], 2),
                    "measured_recommended_ms": round(medians[round(rec, 3)], 2) if rec else None,
                    "measured_best": min(CAPS, key=medians.__getitem__),
                    "measured_best_ms": round(min(medians.values()), 2),
                    "confidence": w.confidence,
                    "calibration_error_pct": round(w.calibration_error_pct, 1),
                    "gain_ms": [round(w.gain_ms, 2), round(w.low_gain_ms, 2)] if rec else None,
                    "comm_model": w.to_dict()["comm_model"],
                }
    return rows, picks


def _same_layout_spread(rows: list[dict[str, Any]]) -> list[float]:
    """Per (model, round), how far apart caps with the same layout measured (%): the error a perfect
    replay would show here, the machine's own noise."""
    spread = []
    groups: dict[tuple[int, str, int, int], list[float]] = {}
    for r in rows:
        if r["base"] == rows[0]["base"]:
            groups.setdefault((r.get("set", 0), r["model"], r["round"], r["buckets"]), []).append(r["measured_ms"])
    for times in groups.values():
        if len(times) > 1:
            spread.append(100 * (max(times) / min(times) - 1))
    return spread


def _rounds_in(out: Path) -> int:
    """How many rounds a kept run holds (one log directory per model, cap and round)."""
    return len(list(out.glob(f"{MODELS[0]}-{CAPS[0]:g}-r*")))


def _pooled(rows: list[dict[str, Any]]) -> None:
    """Over every round of every set: per (base, model, cap) the median of predicted and of measured
    step against the same round's base run, and how far apart they are."""
    base_ms = {
        (r["set"], r["base"], r["model"], r["round"]): r["measured_ms"] for r in rows if r["bucket_cap_mb"] == r["base"]
    }
    ratios: dict[tuple[float, str, float], tuple[list[float], list[float]]] = {}
    for r in rows:
        if r["bucket_cap_mb"] != r["base"]:
            b = base_ms[(r["set"], r["base"], r["model"], r["round"])]
            pred, meas = ratios.setdefault((r["base"], r["model"], r["bucket_cap_mb"]), ([], []))
            pred.append(r["predicted_ms"] / b)
            meas.append(r["measured_ms"] / b)
    errors = []
    for (base, model, cap), (pred, meas) in sorted(ratios.items()):
        p, m = statistics.median(pred), statistics.median(meas)
        errors.append(100 * abs(p - m) / m)
        print(
            f"{base:>5g} {model:<11} {cap:>7g}  predicted x{p:.2f}  measured x{m:.2f} ({min(meas):.2f}-{max(meas):.2f})"
        )
    print(
        f"pooled over {len(meas)} rounds: median error {statistics.median(errors):.1f}% over {len(errors)} "
        f"(model, cap) of the step against the base run's (max {max(errors):.1f}%)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--base", type=float, default=25.0, help="the cap whose run the simulator sees")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", type=Path, help="keep the runs' logs and measured times here")
    ap.add_argument(
        "--reuse", type=Path, nargs="+", help="predict again from the logs --keep runs left (no training); pools them"
    )
    args = ap.parse_args()
    bases = sorted({args.base, min(CAPS)})  # the default-like cap, and the smallest (latency-bound)

    rows: list[dict[str, Any]] = []
    picks: dict[str, Any] = {}
    for n, source in enumerate(args.reuse or [None]):
        with tempfile.TemporaryDirectory(prefix="ddpdoctor-whatif-") as tmp:
            out = str(source or args.keep or tmp)
            if source is not None:
                measured, rounds = _load_measured(source / "measured.json"), _rounds_in(source)
            else:
                load, rounds = os.getloadavg()[0], args.rounds
                measured = _measure(out, args.steps, rounds)
                print(f"load average (1 min) {load:.1f} before, {os.getloadavg()[0]:.1f} after")
                if args.keep:
                    (args.keep / "measured.json").write_text(json.dumps([[m, c, v] for (m, c), v in measured.items()]))
            for base in bases:
                base_rows, base_picks = _predictions(out, base, rounds, measured)
                rows += [{**r, "set": n} for r in base_rows]
                if n == 0:
                    picks.update(base_picks)
    print(f"{'base':>5} {'model':<11} {'cap MiB':>7} {'buckets':>7} {'predicted':>10} {'measured':>9} {'error':>6}")
    for r in rows:
        print(
            f"{r['base']:>5g} {r['model']:<11} {r['bucket_cap_mb']:>7g} {r['buckets']:>7} {r['predicted_ms']:>8.1f}ms "
            f"{r['measured_ms']:>7.1f}ms {r['error_pct']:>5.1f}%  (round {r['round']})"
        )
    for base in bases:
        errors = [r["error_pct"] for r in rows if r["base"] == base and r["bucket_cap_mb"] != base]
        if errors:
            print(
                f"from {base:g} MiB: median prediction error {statistics.median(errors):.1f}% over {len(errors)} "
                f"(model, cap, round) (max {max(errors):.1f}%)"
            )
    spread = _same_layout_spread(rows)
    if spread:
        print(
            f"the noise: caps with the same layout in one round measured {statistics.median(spread):.1f}% apart "
            f"(median; max {max(spread):.1f}%)"
        )
    for m, pick in picks.items():
        rec = pick["recommended"]
        outcome = (
            f"recommended {rec:g} MiB (predicted saving {pick['gain_ms'][0]} ms, at least {pick['gain_ms'][1]} "
            f"in 3 of 4 steps), measured {pick['measured_recommended_ms']} ms"
            if rec
            else f"no cap recommended ({pick['verdict']})"
        )
        print(
            f"{m}: measured {pick['measured_base_ms']} ms there, best {pick['measured_best']:g} MiB "
            f"({pick['measured_best_ms']} ms); {outcome}; confidence {pick['confidence']} (calibration "
            f"{pick['calibration_error_pct']}%); advice: {pick['advice']}"
        )
    if args.reuse and len(args.reuse) > 1:
        _pooled(rows)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "picks": picks, "same_layout_spread_pct": spread}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

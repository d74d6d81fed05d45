"""The user's warnings filters and ddpdoctor's warnings, on real 2-rank gloo DDP.

A filter that makes warnings errors for the script's own sake (``python -W error``,
``PYTHONWARNINGS=error::UserWarning``, a test runner's ``filterwarnings = error``) must never
turn one of ddpdoctor's warnings into an exception inside training: it used to escape from the
forward (and took ddpdoctor's probes down with it). A filter that names a ddpdoctor category
("error" for ``StaleRequiresGradWarning``: stop at once) gets exactly that: the warning raised
from the forward of the step that showed it."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpdoctor
from ddpdoctor.events import FindingRecord, ProbeOff
from ddpdoctor.sinks import MemorySink
from tests.ddp_harness import run_ranks

FREEZE_AT = 3


def _train(rank: int, mode: str) -> dict[str, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    # find_unused_parameters=True: DDP itself survives the frozen layer, so what stops is ours
    ddp = DDP(net, find_unused_parameters=True)
    sink = MemorySink()
    outcome = "completed"
    losses: list[float] = []
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        if mode == "blanket":
            warnings.simplefilter("error")
        elif mode == "explicit":
            warnings.filterwarnings("error", category=ddpdoctor.StaleRequiresGradWarning)
        monitor = ddpdoctor.instrument(ddp, sink=sink)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        try:
            for step in range(8):
                if step == FREEZE_AT:
                    net[0].weight.requires_grad_(False)
                loss = ddp(torch.randn(4, 8, generator=g)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        except ddpdoctor.StaleRequiresGradWarning:
            outcome = f"stopped at step {step}"
        monitor.close()
    found = [r.code for r in sink.records if isinstance(r, FindingRecord)]
    return {
        "outcome": outcome,
        "losses": losses,
        "found": found,
        "shown": [w.category.__name__ for w in shown],
        "probes_off": [r.probe for r in sink.records if isinstance(r, ProbeOff)],
    }


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    return {mode: _train(rank, mode) for mode in ("default", "blanket", "explicit")}


def test_a_blanket_error_filter_never_breaks_training_and_a_named_one_stops_it() -> None:
    for r in run_ranks(_worker):
        default, blanket, explicit = r["default"], r["blanket"], r["explicit"]
        assert default["outcome"] == "completed" and "frozen-after-wrap" in default["found"]
        assert "StaleRequiresGradWarning" in default["shown"]
        # -W error meant for the script: training goes on, the same losses, the finding logged,
        # no probe of ddpdoctor's switched off
        assert blanket["outcome"] == "completed" and blanket["losses"] == default["losses"]
        assert "frozen-after-wrap" in blanket["found"] and blanket["probes_off"] == []
        # the category named as an error: raised from the forward of the step that froze it
        assert explicit["outcome"] == f"stopped at step {FREEZE_AT}"
        assert explicit["losses"] == default["losses"][:FREEZE_AT]

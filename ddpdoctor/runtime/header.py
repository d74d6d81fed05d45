"""The run header: every DDP option, the environment, and what parameters and buffers were."""

from __future__ import annotations

import os
import platform
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist

from ddpdoctor.events import SCHEMA_VERSION, BufferInfo, Header, ParamInfo
from ddpdoctor.runtime import torch_compat
from ddpdoctor.runtime.step.clocks import mono_ns, wall_ns


def ddp_options(ddp: Any) -> dict[str, Any]:
    """DDP's constructor options as the instance holds them (both spellings of buffer sync)."""
    cap_bytes = getattr(ddp, "bucket_bytes_cap", None)
    forward_sync = torch_compat.buffer_sync(ddp)  # both spellings (2.13 renamed it)
    options: dict[str, Any] = {
        "bucket_cap_mb": cap_bytes / 2**20 if cap_bytes else None,
        "bucket_bytes_cap": cap_bytes,
        "first_bucket_bytes_cap": torch_compat.first_bucket_bytes_cap(ddp),
        "find_unused_parameters": bool(getattr(ddp, "find_unused_parameters", False)),
        "static_graph": bool(getattr(ddp, "static_graph", False)),
        "gradient_as_bucket_view": bool(getattr(ddp, "gradient_as_bucket_view", False)),
        "broadcast_buffers": bool(forward_sync),
        "forward_sync_buffers": bool(forward_sync),
        "device_ids": list(getattr(ddp, "device_ids", None) or []),
        "output_device": getattr(ddp, "output_device", None),
        "dim": getattr(ddp, "dim", 0),
        "parameters_to_ignore": sorted(getattr(ddp, "parameters_to_ignore", None) or []),
        "mixed_precision": repr(ddp.mixed_precision) if getattr(ddp, "mixed_precision", None) else None,
        "skip_all_reduce_unused_params": bool(getattr(ddp, "skip_all_reduce_unused_params", False)),
        "join_enabled": bool(getattr(getattr(ddp, "_join_config", None), "enable", False)),
    }
    try:
        logged = torch_compat.logging_data(ddp)
        options["comm_hook"] = logged.get("comm_hook") or None
        options["gloo_num_threads"] = logged.get("gloo_num_threads")
    except Exception:  # noqa: BLE001, S110 - private DDP logging data is optional; attaching must never break training
        pass
    return options


def _checksum(t: torch.Tensor) -> float:
    if t.is_complex() or not t.numel():
        return 0.0
    return float(t.detach().double().sum()) if t.is_floating_point() else float(t.detach().sum())


def build_header(
    ddp: Any, rank: int, ddp_index: int, run_id: str, clock: str, reason: str = "attach", first_step: int = 0
) -> Header:
    """Everything a reader needs to interpret this rank's records, taken at attach time."""
    group = ddp.process_group
    world_size = group.size() if group is not None else 1
    group_ranks: list[int] = []
    whole_world = 0
    try:
        if group is not None and dist.is_initialized() and world_size != dist.get_world_size():
            group_ranks = sorted(int(r) for r in dist.get_process_group_ranks(group))
            # a live reader must know the other groups' ranks exist before their first record
            whole_world = int(dist.get_world_size())
    except Exception:  # noqa: BLE001 - the group's members are optional; attaching must never break training
        group_ranks, whole_world = [], 0
    try:
        backend = str(dist.get_backend(group))
    except Exception:  # noqa: BLE001 - the backend name is optional; attaching must never break training
        backend = ""
    ignore = set(getattr(ddp, "parameters_to_ignore", None) or [])
    params = [
        ParamInfo(
            name=n,
            shape=list(p.shape),
            dtype=str(p.dtype).removeprefix("torch."),
            numel=p.numel(),
            requires_grad=bool(p.requires_grad),
            ignored=n in ignore,
            reduced=bool(p.requires_grad) and n not in ignore,
        )
        for n, p in ddp.module.named_parameters()
    ]
    broadcast_ids = {id(b) for b in getattr(ddp, "modules_buffers", [])}
    will_sync = torch_compat.buffer_sync(ddp)
    buffers = []
    with torch.no_grad():
        for n, b in ddp.module.named_buffers():
            buffers.append(
                BufferInfo(
                    name=n,
                    shape=list(b.shape),
                    dtype=str(b.dtype).removeprefix("torch."),
                    bytes=b.numel() * b.element_size(),
                    broadcast=will_sync and id(b) in broadcast_ids,
                    version=int(b._version),
                    checksum=_checksum(b) if b.device.type == "cpu" else 0.0,
                    ignored=n in ignore,
                )
            )
    return Header(
        rank=rank,
        ddp=ddp_index,
        schema=SCHEMA_VERSION,
        run_id=run_id,
        world_size=world_size,
        local_rank=int(os.environ.get("LOCAL_RANK", rank)),
        host=socket.gethostname(),
        pid=os.getpid(),
        backend=backend,
        device=str(getattr(ddp, "device", "cpu")),
        clock=clock,
        torch=str(torch.__version__),
        python=platform.python_version(),
        argv=list(sys.argv),
        t_mono_ns=mono_ns(),
        t_wall_ns=wall_ns(),
        ddp_options=ddp_options(ddp),
        params=params,
        buffers=buffers,
        reason=reason,
        first_step=first_step,
        group_ranks=group_ranks,
        dist_world_size=whole_world,
    )

"""``ddpdoctor.check_replicas``: the explicit, on-demand cross-rank comparison of a model."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddpdoctor.analysis.findings import Finding
from ddpdoctor.analysis.replicas import compare_fingerprints
from ddpdoctor.events import BufferInfo, Fingerprint, Header, ParamInfo
from ddpdoctor.runtime import torch_compat
from ddpdoctor.runtime.attach import monitor_of
from ddpdoctor.runtime.checks.fingerprints import Fingerprinter
from ddpdoctor.runtime.checks.live_findings import warn_finding


def check_replicas(model: torch.nn.Module, group: Any = None, warn: bool = True) -> list[Finding]:
    """Compare every parameter and buffer across ranks; call on every rank (it is a collective).

    Works on a DDP model or a plain module. Each rank computes an L2 norm and the exact bits
    (``fingerprints.tensor_bits``) per tensor, and a sum per buffer, and the ranks exchange them
    (one small ``all_gather_object``), so the check costs a pass or two over the weights.
    Buffers that DDP broadcasts at every forward are not compared (they differ between forwards
    by design), nor what DDP was told to ignore (``parameters_to_ignore``).

    Returns:
        ``replica-divergence`` / ``buffer-divergence`` findings naming the tensors and the ranks
        that differ (empty when the replicas are identical). With ``warn``, each is also raised as
        a ``ReplicaDivergenceWarning`` and logged when the model is instrumented.
    """
    ddp = model if isinstance(model, TorchDDP) else None
    module = ddp.module if ddp is not None else model
    if group is None and ddp is not None:
        group = ddp.process_group
    params = list(module.named_parameters())
    # DDP leaves these to the script (``_set_params_and_buffers_to_ignore_for_model``): not compared
    ignored = set(getattr(ddp, "parameters_to_ignore", None) or []) if ddp is not None else set()
    buffers = list(module.named_buffers())
    broadcast = (
        {id(b) for b in getattr(ddp, "modules_buffers", [])}
        if ddp is not None and torch_compat.buffer_sync(ddp)
        else set()
    )
    n = len(params)
    # the sampled checks' fingerprint (its Python route), waited for: this check is a collective
    got: list[tuple[list[float], list[float], list[int]]] = []
    fingerprinter = Fingerprinter(lambda _meta, *values: got.append(values))
    fingerprinter.take([p for _, p in params] + [b for _, b in buffers], n, None)
    fingerprinter.drain()
    norms, sums, bits = got[0]
    world = dist.get_world_size(group)
    try:  # findings name global ranks, as the logs do (DDP over a subgroup: not 0..n-1)
        members = [int(r) for r in dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)]
    except Exception:  # noqa: BLE001 - an older torch without the call: the group's own ranks
        members = list(range(world))
    if len(members) != world:
        members = list(range(world))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (norms, sums, bits), group=group)
    header = Header(
        rank=dist.get_rank(),
        params=[
            ParamInfo(
                name=name,
                shape=list(p.shape),
                dtype=str(p.dtype).removeprefix("torch."),
                numel=p.numel(),
                requires_grad=p.requires_grad,
                ignored=name in ignored,
            )
            for name, p in params
        ],
        buffers=[
            BufferInfo(
                name=name,
                shape=list(b.shape),
                dtype=str(b.dtype).removeprefix("torch."),
                bytes=b.numel() * b.element_size(),
                broadcast=id(b) in broadcast,
                ignored=name in ignored,
            )
            for name, b in buffers
        ],
    )
    monitor = monitor_of(ddp) if ddp is not None else None
    step = monitor.recorder.next_index if monitor is not None else 0
    prints = {
        r: [
            Fingerprint(
                rank=r,
                step=step,
                param_norms=g[0][:n],
                param_bits=g[2][:n],
                buffer_norms=g[0][n:],
                buffer_sums=g[1],
                buffer_bits=g[2][n:],
                after_broadcast=True,
            )
        ]
        for r, g in zip(members, gathered, strict=True)
    }
    findings = compare_fingerprints(header, prints)
    if warn:
        for f in findings:
            if monitor is not None:
                monitor.live.raise_findings([f])
                error, monitor.live.error = monitor.live.error, None
            else:
                error = warn_finding(f, header.rank)
            if error is not None:
                raise error  # the user's filter asked for it as an error; this is their own call
    return findings

"""``ddpdoctor.rewrap``: rebuild DDP after requires_grad changes, keeping everything else."""

from __future__ import annotations

import inspect
import warnings
from typing import Any, cast

from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddpdoctor.runtime import torch_compat
from ddpdoctor.runtime.attach import monitor_of


def constructor_options(ddp: TorchDDP) -> dict[str, Any]:
    """The options ``ddp`` was built with, as keyword arguments of DDP's constructor."""
    accepted = set(inspect.signature(TorchDDP.__init__).parameters)
    # from the exact byte cap (the config's own bucket_cap_mb is rounded to whole MiB)
    cap_mb = ddp.bucket_bytes_cap / 2**20 if getattr(ddp, "bucket_bytes_cap", None) else None
    options: dict[str, Any] = {
        "device_ids": ddp.device_ids,
        "output_device": ddp.output_device,
        "dim": ddp.dim,
        "process_group": ddp.process_group,
        "bucket_cap_mb": cap_mb,
        "find_unused_parameters": ddp.find_unused_parameters,
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "static_graph": ddp.static_graph,
        "mixed_precision": getattr(ddp, "mixed_precision", None),
        "skip_all_reduce_unused_params": getattr(ddp, "skip_all_reduce_unused_params", False),
    }
    # broadcast_buffers=False also skips the buffer sync at construction: rank-local buffers
    # must stay rank-local through a rewrap (torch_compat spells it for this torch)
    options |= torch_compat.buffer_sync_kwargs(torch_compat.buffer_sync(ddp))
    return {k: v for k, v in options.items() if k in accepted}


def _user_hook(ddp: TorchDDP) -> tuple[Any, Any] | None:
    monitor = monitor_of(ddp)
    if monitor is not None and monitor.hook_state is not None:
        state = monitor.hook_state
        return (state.inner_hook, state.inner_state) if state.user_hook_name is not None else None
    hooks = getattr(ddp, "_comm_hooks", None) or []
    return hooks[-1] if hooks else None


def rewrap(ddp_model: TorchDDP, **overrides: Any) -> TorchDDP:
    """Build a new DDP over ``ddp_model.module`` after requires_grad changes; call on every rank.

    DDP decides once, in its constructor, which gradients it all-reduces, so parameters frozen or
    unfrozen later are mishandled until DDP is rebuilt. ``rewrap`` rebuilds it with the same
    options (``overrides`` replace some, e.g. ``find_unused_parameters=True``), re-registers the
    user's communication hook, moves an attached ddpdoctor monitor to the new instance (same log,
    step numbers go on), and detaches the old one. Parameters are the same tensors, so an existing
    optimizer keeps working. Like DDP's constructor it broadcasts parameters from rank 0.

    The old model is touched only once the new one is built: a mistyped override, or a
    constructor that raises, leaves ``ddp_model`` exactly as it was (still training).

    Returns:
        The new ``DistributedDataParallel`` (``ddpdoctor.DistributedDataParallel`` if that is what
        was passed in): use it in place of the old one.
    """
    if not isinstance(ddp_model, TorchDDP):
        raise TypeError(f"rewrap expects a DistributedDataParallel model, got {type(ddp_model).__name__}")
    accepted = set(inspect.signature(TorchDDP.__init__).parameters) - {"self", "module"}
    unknown = sorted(set(overrides) - accepted)
    if unknown:
        raise TypeError(
            f"rewrap: DistributedDataParallel (torch {torch_compat.TORCH_VERSION}) takes no "
            f"option(s) {', '.join(unknown)}"
        )
    options = constructor_options(ddp_model) | overrides
    if "forward_sync_buffers" in overrides:
        options.pop("broadcast_buffers", None)
    elif "broadcast_buffers" in overrides:
        options.pop("forward_sync_buffers", None)
    hook = _user_hook(ddp_model)
    monitor = monitor_of(ddp_model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        new = TorchDDP(ddp_model.module, **options)  # the old model still has its hooks if this raises
    # from here on the new model is built: the old reducer must not see the coming backwards
    ddp_model._remove_autograd_hooks()
    if monitor is not None:
        monitor.reattach(new)
    if hook is not None:
        new.register_comm_hook(hook[1], hook[0])
    from ddpdoctor.runtime.ddp import DistributedDataParallel

    if isinstance(ddp_model, DistributedDataParallel):
        new.__class__ = DistributedDataParallel  # adds no state but the monitor attribute
        drop_in = cast(DistributedDataParallel, new)  # its class was just set
        drop_in.ddpdoctor = monitor if monitor is not None and not monitor.closed else ddp_model.ddpdoctor
    return new


__all__ = ["constructor_options", "rewrap"]

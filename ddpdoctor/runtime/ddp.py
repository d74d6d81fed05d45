"""A drop-in ``DistributedDataParallel`` that instruments itself."""

from __future__ import annotations

import os
from typing import Any

import torch

from ddpdoctor.runtime.monitor import Monitor, instrument


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """``torch.nn.parallel.DistributedDataParallel`` with ddpdoctor attached at construction.

    Takes the same arguments, plus ``ddpdoctor_run_dir`` and ``ddpdoctor_options`` (keyword
    arguments of ``ddpdoctor.instrument``). The monitor is ``self.ddpdoctor``. Attaching in the
    constructor means the requires_grad snapshot is exactly what DDP saw.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *args: Any,
        ddpdoctor_run_dir: str | os.PathLike[str] | None = None,
        ddpdoctor_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(module, *args, **kwargs)
        self.ddpdoctor: Monitor = instrument(self, ddpdoctor_run_dir, **(ddpdoctor_options or {}))

"""A drop-in ``DistributedDataParallel`` that instruments itself."""

from __future__ import annotations

import os
from typing import Any

import torch

from ddpdoctor.runtime.config import Options
from ddpdoctor.runtime.monitor import Monitor, instrument


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """``torch.nn.parallel.DistributedDataParallel`` with ddpdoctor attached at construction.

    Takes the same arguments, plus ``ddpdoctor_run_dir`` and ``ddpdoctor_options`` (an
    ``Options``, or a dict of its fields: the keywords of ``ddpdoctor.instrument``). The monitor
    is ``self.ddpdoctor``. Attaching in the constructor means the requires_grad snapshot is
    exactly what DDP saw. A copy (``copy.deepcopy``, ``torch.save``/``torch.load``) is not
    monitored: its ``ddpdoctor`` does nothing.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *args: Any,
        ddpdoctor_run_dir: str | os.PathLike[str] | None = None,
        ddpdoctor_options: Options | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # ddpdoctor's own options are checked before DDP is built
        if isinstance(ddpdoctor_options, Options):
            options = ddpdoctor_options
        else:
            options = Options.of(None, **(ddpdoctor_options or {}))
        super().__init__(module, *args, **kwargs)
        self.ddpdoctor: Monitor = instrument(self, ddpdoctor_run_dir, options=options)

"""Where a framework builds the DDP model: its own spelling of a DDP option.

A user of transformers' ``Trainer``, Lightning or Accelerate never calls DDP's constructor, so a
fix that names a constructor argument also names the switch that reaches it. (transformers'
``Trainer`` builds DDP with ``find_unused_parameters=True`` unless told otherwise, for instance.)
"""

from __future__ import annotations


def framework_switches(option: str, transformers: str) -> str:
    """Comment lines for a fix: ``option`` (``name=value``, as DDP's constructor takes it) where
    transformers (``transformers``: its ``TrainingArguments`` field), Lightning and Accelerate
    wrap the model."""
    return (
        f"\n    # where a framework wraps the model: transformers TrainingArguments({transformers}),"
        f"\n    # Lightning DDPStrategy({option}),"
        f"\n    # Accelerate Accelerator(kwargs_handlers=[DistributedDataParallelKwargs({option})])"
    )

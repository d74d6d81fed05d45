"""``DDPDoctorCallback`` for transformers' ``Trainer``: ddpdoctor's figures and findings in its reports.

    from ddpdoctor.integrations.transformers import DDPDoctorCallback

    Trainer(model=model, args=TrainingArguments(..., report_to=["tensorboard"]), callbacks=[DDPDoctorCallback()])

At the start of training every rank attaches ddpdoctor to the ``DistributedDataParallel`` the
``Trainer`` built (unless ``ddpdoctor run`` or ``ddpdoctor.instrument`` already did: never twice).
Every ``every_n_steps`` steps, rank 0 hands the per-rank and per-run figures of the steps every
rank logged since (``trainer_log.metrics_of``) to the reporting integrations ``report_to`` set up
(TensorBoard, W&B, ...), through their own ``on_log``, each step at its own step index; the
integrations write them as they write the loss (TensorBoard and W&B put them under ``train/``).
Each new finding goes to them as text, and to transformers' log. Rank 0 reads the run dir the
ranks already write: no collective is added, and the ``Trainer``'s own logging (which gathers the
loss across ranks) is left to its ``logging_steps``.

A ``TrainerCallback`` is not given the trainer: the callback finds it, and the callback handler
that lists the reporting integrations, among the frames that called it at the start of training.
"""

from __future__ import annotations

import copy
import sys
from types import FrameType
from typing import Any

try:
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.integrations import get_reporting_integration_callbacks
    from transformers.trainer_callback import CallbackHandler
    from transformers.utils import logging as hf_logging
except ImportError as exc:
    raise ImportError(
        f"ddpdoctor's transformers callback needs transformers ({exc}): pip install 'ddpdoctor[transformers]'"
    ) from exc

from ddpdoctor.integrations.follow import Update
from ddpdoctor.integrations.trainer_log import (
    EVERY_N_STEPS,
    FINDINGS_COUNT_KEY,
    FINDINGS_KEY,
    TrainerWatch,
    finding_markdown,
    log_finding,
    metrics_of,
)

#: transformers' own log (its library logger has the handler and verbosity transformers set)
log = hf_logging.get_logger("transformers.integrations.ddpdoctor")

#: How far up the stack the trainer is looked for (the handler's ``call_event``, then the trainer).
_MAX_FRAMES = 8


def _callers() -> tuple[Trainer | None, CallbackHandler | None]:
    """The ``Trainer`` and ``CallbackHandler`` whose event is being handled, from the calling frames."""
    trainer = handler = None
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None or (trainer is not None and handler is not None):
            break
        obj = frame.f_locals.get("self")
        if handler is None and isinstance(obj, CallbackHandler):
            handler = obj
        elif trainer is None and isinstance(obj, Trainer):
            trainer = obj
        frame = frame.f_back
    return trainer, handler


class DDPDoctorCallback(TrainerCallback):
    """Logs ddpdoctor's per-step figures and findings through the ``Trainer``'s reporting
    integrations, from rank 0.

    Args:
        every_n_steps: steps between two rounds of logging (each round logs every step all ranks
            logged since, at its own step).
        **options: ddpdoctor's options when this callback attaches it (``run_dir``,
            ``hang_timeout``, ...: ``ddpdoctor.runtime.config.Options``); a monitor attached
            before (``ddpdoctor run``) keeps its own.
    """

    def __init__(self, every_n_steps: int = EVERY_N_STEPS, **options: Any) -> None:
        self.watch = TrainerWatch(every_n_steps, options)
        self._reporters: list[Any] = []

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        trainer, handler = _callers()
        if trainer is None:
            self.watch.why_not = "the Trainer was not found among the callers of on_train_begin"
        else:
            self.watch.attach(trainer.model_wrapped, args.process_index)
        if handler is not None:
            kinds = tuple(get_reporting_integration_callbacks(args.report_to))
            self._reporters = [cb for cb in handler.callbacks if kinds and isinstance(cb, kinds)]
            first = min((handler.callbacks.index(cb) for cb in self._reporters), default=None)
            mine = handler.callbacks.index(self) if self in handler.callbacks else None
            if first is not None and mine is not None and mine > first:
                # before the integrations, so that at the end of training the last figures reach
                # them before they close. Moving an earlier entry of the list being iterated
                # leaves the entries after it where they were: every callback is still called once
                handler.callbacks.insert(first, handler.callbacks.pop(mine))
        if not self._reporters and not self.watch.why_not:
            self.watch.why_not = (
                f"no reporting integration to log figures to (report_to={args.report_to!r}); "
                "findings go to this log only"
            )
        if self.watch.why_not and state.is_world_process_zero:
            log.info("ddpdoctor: %s", self.watch.why_not)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.watch.due(state.global_step):
            self._log(args, state, control, self.watch.take(), kwargs)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._log(args, state, control, self.watch.finish(), kwargs)

    def _log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, update: Update, kwargs: Any
    ) -> None:
        if (error := self.watch.read_error()) is not None:
            log.warning(error)
        extra = {k: v for k, v in kwargs.items() if k != "logs"}
        for sf in update.steps:
            self._report(args, state, control, sf.step, dict(metrics_of(sf)), extra)
        last = update.steps[-1].step if update.steps else state.global_step
        for f in update.findings:
            log_finding(log, f)
            step = f.step if f.step is not None else last
            self._report(args, state, control, step, {FINDINGS_KEY: finding_markdown(f)}, extra)
        if update.findings:
            self._report(args, state, control, last, {FINDINGS_COUNT_KEY: float(self.watch.findings_seen)}, extra)

    def _report(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        step: int,
        logs: dict[str, Any],
        extra: dict[str, Any],
    ) -> None:
        # the integrations log at ``state.global_step``: a copy of the state says which step
        at = copy.copy(state)
        at.global_step = step
        for cb in self._reporters:
            cb.on_log(args, at, control, logs=dict(logs), **extra)


__all__ = ["DDPDoctorCallback"]

"""``DDPDoctorCallback`` for Lightning: ddpdoctor's figures and findings in the trainer's loggers.

    from ddpdoctor.integrations.lightning import DDPDoctorCallback

    trainer = L.Trainer(strategy="ddp", logger=TensorBoardLogger("tb"), callbacks=[DDPDoctorCallback()])

At the start of training every rank attaches ddpdoctor to the strategy's
``DistributedDataParallel`` (unless ``ddpdoctor run`` or ``ddpdoctor.instrument`` already did:
never twice). Every ``every_n_steps`` trainer steps, rank 0 gives each of ``trainer.loggers``
(TensorBoard, W&B, CSV: whatever is configured) the per-rank and per-run figures of the steps
every rank logged since (``trainer_log.metrics_of``), and each new finding: as text where the
logger takes text (TensorBoard, W&B), as a running count everywhere, and as a line in Lightning's
own log. Rank 0 reads the run dir the ranks already write: no collective is added.

Works with the ``lightning`` package, or ``pytorch_lightning`` where only that is installed.
"""

from __future__ import annotations

import logging
from typing import Any

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

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:  # the standalone package
    try:
        from pytorch_lightning import Callback, LightningModule, Trainer  # type: ignore[assignment]
    except ImportError as exc:
        raise ImportError(
            f"ddpdoctor's Lightning callback needs Lightning ({exc}): pip install 'ddpdoctor[lightning]'"
        ) from exc

#: Lightning's own log (its package logger has the handler Lightning set up).
log = logging.getLogger(".".join((Callback.__module__.rsplit(".", 1)[0], "ddpdoctor")))

#: The text columns of a finding in a W&B table.
_COLUMNS = ["step", "severity", "code", "ranks", "title", "detail", "fix"]


class DDPDoctorCallback(Callback):
    """Logs ddpdoctor's per-step figures and findings through the trainer's loggers, from rank 0.

    Args:
        every_n_steps: trainer steps between two rounds of logging (each round logs every step
            all ranks logged since, at its own step).
        **options: ddpdoctor's options when this callback attaches it (``run_dir``,
            ``hang_timeout``, ...: ``ddpdoctor.runtime.config.Options``); a monitor attached
            before (``ddpdoctor run``) keeps its own.
    """

    def __init__(self, every_n_steps: int = EVERY_N_STEPS, **options: Any) -> None:
        super().__init__()
        self.watch = TrainerWatch(every_n_steps, options)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.watch.attach(trainer.strategy.model, trainer.global_rank)
        if self.watch.why_not and trainer.global_rank == 0:
            log.info("ddpdoctor: %s", self.watch.why_not)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.watch.due(trainer.global_step):
            self._log(trainer, self.watch.take())

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log(trainer, self.watch.finish())

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.watch.follower is not None:  # training stopped by an exception: stop reading
            self.watch.follower.close()
            self.watch.follower = None

    def _log(self, trainer: Trainer, update: Update) -> None:
        if (error := self.watch.read_error()) is not None:
            log.warning(error)
        for sf in update.steps:
            metrics = metrics_of(sf)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=sf.step)
        last = update.steps[-1].step if update.steps else None
        for f in update.findings:
            log_finding(log, f)
            step = f.step if f.step is not None else (last or 0)
            for logger in trainer.loggers:
                _log_text(logger, f, step)
        if update.findings:
            for logger in trainer.loggers:
                logger.log_metrics({FINDINGS_COUNT_KEY: float(self.watch.findings_seen)}, step=last or 0)
        if update.steps or update.findings:
            for logger in trainer.loggers:
                logger.save()


def _log_text(logger: Any, f: Any, step: int) -> None:
    """A finding as text in loggers that take text: TensorBoard's writer, a W&B table."""
    add_text = getattr(getattr(logger, "experiment", None), "add_text", None)
    if add_text is not None:  # TensorBoardLogger: a SummaryWriter
        add_text(FINDINGS_KEY, finding_markdown(f), global_step=step)
    elif hasattr(logger, "log_text"):  # WandbLogger
        row = [step, f.severity, f.code, ",".join(map(str, f.ranks)), f.title, f.detail, f.fix]
        logger.log_text(key=FINDINGS_KEY, columns=_COLUMNS, data=[row])


__all__ = ["DDPDoctorCallback"]

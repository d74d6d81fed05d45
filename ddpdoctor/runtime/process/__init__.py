"""What one process shares among its monitors, whatever the number of DDP models it watches.

Here: ``services`` (``Services``: one object that every monitor joins and leaves, with one
shutdown), ``exit_flush`` (closing at interpreter exit, flushing on SIGTERM), ``watchdog`` (the
hang watchdog's thread), ``proc_stats`` (the process sampler's thread: CPU, RSS, device memory).

Not here: anything run at every step (``runtime.step``), or the optimizer hooks the services
install (``runtime.step.optimizer_hooks``: their callbacks are on the step's hot path).
"""

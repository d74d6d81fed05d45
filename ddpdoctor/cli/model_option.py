"""``--ddp K`` and ``--job K``: which DDP model's logs a command reads, where each process wrapped
several, and of which job, where several jobs wrote the run dir one after another."""

from __future__ import annotations

import argparse


def add_ddp_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--ddp K`` (default 0, the first DDP model each process wrapped) to ``parser``."""
    parser.add_argument(
        "--ddp",
        type=int,
        default=0,
        metavar="K",
        help="where each process wrapped several DDP models (a GAN's two): read the K-th (default 0, the first)",
    )


def add_job_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--job K`` (default: the last job that wrote the run dir) to ``parser``."""
    parser.add_argument(
        "--job",
        type=int,
        default=None,
        metavar="K",
        help="where several launches wrote the run dir one after another: read the K-th (0 the first, -1 the "
        "last; default the last)",
    )

"""``--ddp K``: which DDP model's logs a command reads, where each process wrapped several."""

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

"""What ``ddpdoctor run`` reads from a torchrun command line (without importing torch).

``ddpdoctor run`` never changes CMD; it only reads torchrun's options to name a run dir that every
node agrees on and to warn about launch settings that break restarts. Options are read the way
torchrun reads them: ``--opt value``, ``--opt=value``, dashes or underscores, and the ``PET_*``
environment variables torchrun falls back to.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath

#: torchrun's options that take no value (torch 2.13); every other option takes one.
_FLAGS = {
    "-h",
    "--help",
    "--standalone",
    "-m",
    "--module",
    "--no-python",
    "--no_python",
    "--run-path",
    "--run_path",
    "--virtual-local-rank",
    "--virtual_local_rank",
}
#: torchrun keeps one rendezvous store for all restarts unless this is "1" (c10d rendezvous only).
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@dataclass(frozen=True)
class TorchrunArgs:
    """The launch settings of one torchrun command that ddpdoctor cares about."""

    max_restarts: int = 0
    rdzv_backend: str = "static"
    rdzv_id: str = "none"
    nnodes: str = "1:1"
    standalone: bool = False
    master_port: str = ""  # as given ("": not given, torchrun's default)

    @property
    def max_nodes(self) -> int:
        """The most nodes the job can span (``--nnodes 2`` or ``--nnodes 1:4``)."""
        try:
            return int(self.nnodes.split(":")[-1])
        except ValueError:
            return 1

    @property
    def backend(self) -> str:
        return "c10d" if self.standalone else self.rdzv_backend


def _is_torchrun(cmd: list[str]) -> int | None:
    """Index of the first torchrun argument in ``cmd``, or None when CMD is not torchrun."""
    if not cmd:
        return None
    if PurePath(cmd[0]).name == "torchrun":
        return 1
    for i in range(1, len(cmd) - 1):  # python [options] -m torch.distributed.run
        if cmd[i] == "-m":
            return i + 2 if cmd[i + 1] in ("torch.distributed.run", "torch.distributed.launch") else None
        if not cmd[i].startswith("-"):
            return None
    return None


def parse(cmd: list[str], env: Mapping[str, str] | None = None) -> TorchrunArgs | None:
    """torchrun's settings in ``cmd`` (None when CMD does not start torchrun)."""
    start = _is_torchrun(cmd)
    if start is None:
        return None
    environ: Mapping[str, str] = os.environ if env is None else env
    values: dict[str, str] = {}
    args = cmd[start:]
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-") or arg == "--":
            break  # the training script (or program): its own arguments follow
        name, eq, value = arg.partition("=")
        if name in _FLAGS:
            value = "1"
        elif not eq and i + 1 < len(args):  # --opt value
            i += 1
            value = args[i]
        values[name.lstrip("-").replace("-", "_")] = value
        i += 1

    def get(dest: str, default: str) -> str:
        return values.get(dest, environ.get(f"PET_{dest.upper()}", default))

    try:
        restarts = int(get("max_restarts", "0"))
    except ValueError:
        restarts = 0
    return TorchrunArgs(
        max_restarts=restarts,
        rdzv_backend=get("rdzv_backend", "static"),
        rdzv_id=get("rdzv_id", "none"),
        nnodes=get("nnodes", "1:1"),
        standalone="standalone" in values or environ.get("PET_STANDALONE", "") not in ("", "0"),
        master_port=get("master_port", ""),
    )


def restart_advice(args: TorchrunArgs, env: Mapping[str, str] | None = None) -> str | None:
    """Why this torchrun's restarts may hang or fail, and what to change; None when they are fine.

    torch (2.13 included) keeps one rendezvous TCPStore for every restart round and the workers'
    process groups use the same keys in it each time, so a restarted worker can read an address
    the dead attempt published: it then fails ("Gloo connectFullMesh failed", NCCL "Connection
    refused") or waits for ever in ``init_process_group``. With the c10d rendezvous the store can
    be made per round by ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; the static rendezvous
    (``--master-addr/--master-port``) has no such switch.
    """
    if args.max_restarts <= 0:
        return None
    environ: Mapping[str, str] = os.environ if env is None else env
    if args.backend == "static":
        return (
            "torchrun's static rendezvous (--master-addr/--master-port) keeps one store across restarts: "
            "restarted workers can read the failed attempt's addresses and fail or hang in "
            "init_process_group. For --max-restarts to work use --rdzv-backend c10d --rdzv-endpoint HOST:PORT "
            f"(or --standalone) with {SHARE_STORE_ENV}=1 set."
        )
    if args.backend == "c10d" and environ.get(SHARE_STORE_ENV, "0") != "1":
        return (
            f"torchrun's c10d rendezvous shares its store across restarts unless {SHARE_STORE_ENV}=1: "
            "restarted workers can read the failed attempt's addresses and fail or hang in "
            f"init_process_group. Set {SHARE_STORE_ENV}=1 for --max-restarts to work."
        )
    return None


def port_advice(args: TorchrunArgs) -> str | None:
    """Why this torchrun will hang before training starts, when it will: ``--master-port 0`` with
    the static rendezvous (torch 2.13 and 2.8 alike: every worker waits in
    ``init_process_group`` for a store on port 0 until torchrun's timeout). None otherwise."""
    if args.backend != "static" or args.master_port.strip() != "0":
        return None
    return (
        "torchrun --master-port 0 does not pick a free port for the workers: each one looks for the store on "
        "port 0 and the job hangs in init_process_group. Give a free port, or use --standalone (one node), "
        "which picks one."
    )


def shared_run_name(args: TorchrunArgs) -> str | None:
    """A run dir name every node derives alike, for a job on several nodes: from ``--rdzv-id``."""
    if args.max_nodes <= 1 or args.standalone or args.rdzv_id in ("", "none"):
        return None
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", args.rdzv_id).strip("._") or None
    return f"rdzv-{name}" if name else None

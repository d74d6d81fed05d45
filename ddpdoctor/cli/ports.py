"""A free TCP port on loopback, for the demo's process group (and the tests' and benches')."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the kernel's pick for port 0); free until someone binds it."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])

"""ddpdoctor's environment variables: each declared once, with its default and meaning, and read
through ``read`` alone.

``ddpdoctor run`` and ``ddpdoctor demo`` set the first group for the processes they start; a user
may set them too. The last group is a documented testing API: each makes one failure happen for
real in a child process (a build that fails, an attach step that fails, a rank's clock that is
off), where a test cannot reach in with a fixture. ``tests/test_environment.py`` checks that every
``DDPDOCTOR_*`` name in the package is declared here and listed in the commands reference.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ddpdoctor.events.layout import ENDPOINT_ENV, HANG_TIMEOUT_ENV, LOG_MODE_ENV, RUN_DIR_ENV, TOKEN_ENV

#: ``0``/``off``/``false``/``no`` turns the native comm hook off (the Python hook times the buckets).
NATIVE_ENV = "DDPDOCTOR_NATIVE"
#: Testing: ``compile`` makes the native hook's source fail to compile.
TEST_NATIVE_FAULT_ENV = "DDPDOCTOR_TEST_NATIVE_FAULT"
#: Testing: the name of the attach step to fail at (``runtime.attach``).
TEST_FAIL_ATTACH_ENV = "DDPDOCTOR_TEST_FAIL_ATTACH"
#: Testing: ``RANK:SECONDS``, that rank's wall clock read that many seconds off.
TEST_CLOCK_OFFSET_ENV = "DDPDOCTOR_TEST_CLOCK_OFFSET"


@dataclass(frozen=True)
class Variable:
    """One environment variable ddpdoctor reads."""

    name: str
    #: what ``read`` gives when it is unset or blank
    default: str
    meaning: str
    #: part of the testing API, not for users
    testing: bool = False


VARIABLES: dict[str, Variable] = {
    v.name: v
    for v in (
        Variable(RUN_DIR_ENV, "", "the run dir when `instrument` is given none (set by `run` and `demo`)"),
        Variable(ENDPOINT_ENV, "", "stream every record to `HOST:PORT` as well (`run --endpoint`)"),
        Variable(TOKEN_ENV, "", "the stream's shared secret, presented by senders, required off loopback"),
        Variable(HANG_TIMEOUT_ENV, "", "seconds without progress before a hang is recorded (0: off; unset: 120)"),
        Variable(LOG_MODE_ENV, "compact", "what rank files keep: `compact` or `full`"),
        Variable(NATIVE_ENV, "1", "`0` skips the native hook and times buckets in Python"),
        Variable(TEST_NATIVE_FAULT_ENV, "", "`compile`: the native hook's source fails to compile", testing=True),
        Variable(TEST_FAIL_ATTACH_ENV, "", "the attach step that fails", testing=True),
        Variable(TEST_CLOCK_OFFSET_ENV, "", "`RANK:SECONDS`: that rank's clock is read off by so much", testing=True),
    )
}


def read(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The value of the declared variable ``name`` (stripped), or its default where it is unset
    or blank. A name not declared above is a bug in ddpdoctor: ``KeyError``."""
    variable = VARIABLES[name]
    value = (os.environ if environ is None else environ).get(name, "").strip()
    return value or variable.default


def turned_off(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether a switch variable says off (``0``, ``off``, ``false``, ``no``)."""
    return read(name, environ).lower() in ("0", "off", "false", "no")


__all__ = [
    "NATIVE_ENV",
    "TEST_CLOCK_OFFSET_ENV",
    "TEST_FAIL_ATTACH_ENV",
    "TEST_NATIVE_FAULT_ENV",
    "VARIABLES",
    "Variable",
    "read",
    "turned_off",
]

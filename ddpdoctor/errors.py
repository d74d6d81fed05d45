"""ddpdoctor's exceptions: one base, grouped by cause.

Each concrete error lives beside the code that raises it and derives from one group here, and
also from the builtin it has always been (``RuntimeError``, ``ValueError``, ``OSError``), so code
that catches the builtin keeps working::

    DDPDoctorError
    ├── SetupError      attaching to a DDP model could not be done as asked
    │                   (AttachError, HookUnsupported, NativeUnavailable)
    ├── InputError      what was given to read is not what ddpdoctor reads
    │                   (RunDirError, CorruptLine, UnknownRecord, StreamError)
    └── OutputError     where records go cannot be written (SinkError, ExportError)

None of them is ever raised into a training step: the runtime catches its own failures, turns
the probe off and warns (``ProbeDisabledWarning``); these reach a caller of the API or the CLI.
"""

from __future__ import annotations


class DDPDoctorError(Exception):
    """Base class of every exception ddpdoctor raises."""


class SetupError(DDPDoctorError):
    """Attaching to a DDP model, or one of its probes, could not be set up (the message says why)."""


class InputError(DDPDoctorError):
    """A run dir, a log line, a record or a stream setting that ddpdoctor cannot read as given."""


class OutputError(DDPDoctorError):
    """Where records go (a log file, a stream) cannot be opened or written."""


__all__ = ["DDPDoctorError", "InputError", "OutputError", "SetupError"]

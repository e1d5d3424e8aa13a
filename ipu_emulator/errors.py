"""Errors raised by the emulated device: executable format, compiler, programs.

Classes are chosen by cause:

- ``ExecutableError``: executable bytes are damaged, truncated or inconsistent
  (carries the byte ``offset`` where the problem was found, when known).
- ``CompileError``: the compiler refuses a model (unsupported, too big,
  unresolved dynamic dims, unsafe external data...).
- ``DeviceProgramError``: a program failed while running on the device
  (onnxruntime error, bad switch index...); ``__cause__`` keeps the original.

The host runtime translates these into ``host_runtime.errors`` at its boundary.
"""

from __future__ import annotations

__all__ = [
    "IpuEmulatorError",
    "ExecutableError",
    "CompileError",
    "DeviceProgramError",
]


class IpuEmulatorError(Exception):
    """Base class of every error the emulated device raises on purpose."""


class ExecutableError(IpuEmulatorError, ValueError):
    """Executable bytes are damaged, truncated or inconsistent.

    ``offset`` is the byte offset in the executable where the problem was
    found (``None`` when it concerns the decoded program section as a whole).
    """

    def __init__(self, message: str, *, offset: int | None = None) -> None:
        where = f" [executable offset {offset}]" if offset is not None else ""
        super().__init__(message + where)
        self.offset = offset


class CompileError(IpuEmulatorError, ValueError):
    """The compiler refuses the model; the message says why and how to fix it."""


class DeviceProgramError(IpuEmulatorError, RuntimeError):
    """A device program failed; ``__cause__`` carries the original exception."""

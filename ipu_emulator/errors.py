"""Errors raised by the emulated device: executable format, compiler, programs.

Classes are chosen by cause:

- ``ExecutableError``: executable bytes are damaged, truncated or inconsistent
  (carries the byte ``offset`` where the problem was found, when known).
- ``CompileError``: the compiler refuses a model (unsupported, too big,
  unresolved dynamic dims, unsafe external data...).
- ``DeviceProgramError``: a program failed while running on the device
  (onnxruntime error, bad switch index...); ``__cause__`` keeps the original.
- ``ProtocolError``: a control message or load spec does not follow the
  host/device protocol; ``DaemonProtocolError`` the same for the daemon's.
- ``SystemConfigError``: the emulated machine's configuration is invalid.
- ``ConfigYamlError``: a YAML config file is unreadable, invalid or hostile
  (``ipu_emulator.yaml_config``); callers turn it into their own class.
- ``IpuProcessError``: an IPU process failed to start, or died.
- ``DaemonError`` / ``PoolError``: the daemon or its pool of IPU processes.
- ``HostMemoryError``: a shared host-memory descriptor cannot be resolved.
- ``ForkserverError``: the template process that forks IPU processes cannot
  start or fork (the launcher then starts them fresh).
- ``MetricsServeError``: ``/metrics`` cannot listen where asked.
- ``UnsafePathError``: a folder or file the emulator would write is a symlink,
  belongs to another user or is writable by others (``ipu_emulator.safe_files``).

Every class derives from ``IpuEmulatorError`` (and from the builtin that fits
its cause, so ``except ValueError`` keeps working). The modules that raise
them re-export them under their old import paths.

The host runtime translates these into ``host_runtime.errors`` at its boundary.
"""

from __future__ import annotations

import signal

__all__ = [
    "IpuEmulatorError",
    "ExecutableError",
    "CompileError",
    "DeviceProgramError",
    "ProtocolError",
    "SystemConfigError",
    "ConfigYamlError",
    "IpuProcessError",
    "DaemonError",
    "DaemonProtocolError",
    "DaemonVersionError",
    "PoolError",
    "VipuError",
    "HostMemoryError",
    "ForkserverError",
    "describe_returncode",
    "MetricsServeError",
    "UnsafePathError",
    "RealModulesError",
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


class ProtocolError(IpuEmulatorError, ValueError):
    """A message or load spec does not follow the host/device protocol."""


class SystemConfigError(IpuEmulatorError, ValueError):
    """The emulated system configuration is invalid; the message names the setting."""


class ConfigYamlError(IpuEmulatorError, ValueError):
    """A YAML config file cannot be read, is not YAML, or is refused as hostile (aliases
    that expand too far, nesting too deep); the message names the file and the place."""


class IpuProcessError(IpuEmulatorError, RuntimeError):
    """An IPU process failed to start, or died; the message names it and how."""

    def __init__(self, message: str, *, pid: int | None = None,
                 returncode: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid
        self.returncode = returncode


class DaemonError(IpuEmulatorError, RuntimeError):
    """The daemon cannot start (socket in use, bad path, IPU processes fail)."""


class DaemonProtocolError(IpuEmulatorError, ValueError):
    """A message does not follow the daemon protocol (size, JSON, version)."""


class DaemonVersionError(DaemonProtocolError):
    """The other side speaks another version of the daemon protocol: another
    installation of the emulator, whose wire (rings) may differ too."""


class VipuError(IpuEmulatorError, RuntimeError):
    """A V-IPU partition request was refused (``ipu-emulator vipu``); ``kind`` is the
    daemon's refusal (``partition_not_found``, ``partition_exists``, ``partition_in_use``,
    ``partition_size``, ``request``) or ``config`` for a bad IPUoF setting or file."""

    def __init__(self, message: str, kind: str = "request") -> None:
        super().__init__(message)
        self.kind = kind


class PoolError(IpuEmulatorError, RuntimeError):
    """An IPU of the pool could not be started, handed over or taken back."""


class HostMemoryError(IpuEmulatorError):
    """A TAG_SHARED descriptor that cannot be resolved (the message says why)."""


class ForkserverError(IpuEmulatorError, RuntimeError):
    """The template process could not be started or could not fork."""


class MetricsServeError(IpuEmulatorError, RuntimeError):
    """``/metrics`` cannot listen where asked (port in use, bad address)."""


class UnsafePathError(IpuEmulatorError, PermissionError):
    """A folder or file the emulator would write is a symlink, belongs to another user, or
    is writable by other users; the message names the path and the fix. Nothing was
    written through it."""


def describe_returncode(rc: int | None) -> str:
    """"is running", "exited with code 3", "was killed by signal SIGKILL (9)"."""
    if rc is None:
        return "is running"
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = "?"
        return f"was killed by signal {name} ({-rc})"
    return f"exited with code {rc}"


class RealModulesError(IpuEmulatorError, ImportError):
    """Graphcore's own ``model_runtime``, ``popef`` or ``poprt`` is importable here, and
    mapping the names onto the emulator would hide it; the message names where it is and
    how to use the emulator anyway."""

"""The one exception hierarchy of the host runtime.

Classes are chosen by *cause*, the way trio does it:

- ``BadRequestError``: the caller gave wrong input (names, shapes, dtypes,
  sizes, replica ids, options). Nothing was sent to a device; the object that
  raised it is still usable.
- ``PopefError``: a model file is damaged, truncated or inconsistent
  (``ModelRuleError``: its metadata, anchors and programs break a named rule).
- ``InvalidStateError``: the call does not fit the object's state (closed,
  stopped, not bound to a device).
- ``ForkedProcessError``: an object (runner, session, device, queue, future,
  shared array) was used in a process forked from the one that created it.
- ``SharedMemoryFullError``: /dev/shm cannot hold a model's rings or regions.
- ``ResourceLimitError``: an operating-system limit was reached: no file
  descriptor left (``RLIMIT_NOFILE``, the system's file table) or a file-size
  limit (``RLIMIT_FSIZE``) below a shared-memory object's size.
- ``DeviceUnavailableError``: no device matching the request could be attached
  (``PartitionError``: the V-IPU partition the process was given,
  ``IPUOF_VIPU_API_PARTITION_ID`` or an IPUoF config file, is missing
  (``PartitionNotFoundError``), smaller than the request (``PartitionTooSmallError``)
  or in use by another process (``PartitionBusyError``)).
- ``DeviceLostError``: the emulated IPU process died or stopped answering
  (``SequenceMismatchError``: a transfer read from the device carries another
  request's sequence number; the streams are out of step).
- ``DeviceTimeoutError``: a wait on a device (or on input data) timed out.
- ``DeviceExecutionError``: the program failed on the device; ``__cause__``
  carries the device-side traceback as a ``RemoteTraceback``.
- ``PackageHashMismatchError``: the executable was compiled by another
  emulator version.
- Poplar's runtime error classes, raised by a device that fails the way a real
  IPU does (injected faults, ``ipu_emulator.faults``): ``ApplicationRuntimeError``
  (the program failed; ``auto_reset`` resets the IPU), ``RecoverableRuntimeError``
  (``.recovery_action``, a ``RecoveryAction``: ``IPU_RESET`` is done by
  ``auto_reset``, the others are the user's to do) and
  ``UnrecoverableRuntimeError``. Each names the IPU, the replica and the program.

Wire-level errors from ``shm`` are translated into these at the boundary.
"""

from __future__ import annotations

import enum

__all__ = [
    "ModelRuntimeError",
    "BadRequestError",
    "PopefError",
    "ModelRuleError",
    "InvalidStateError",
    "ForkedProcessError",
    "SharedMemoryFullError",
    "ResourceLimitError",
    "DeviceUnavailableError",
    "PartitionError",
    "PartitionNotFoundError",
    "PartitionTooSmallError",
    "PartitionBusyError",
    "DeviceLostError",
    "SequenceMismatchError",
    "DeviceTimeoutError",
    "DeviceExecutionError",
    "PackageHashMismatchError",
    "RemoteTraceback",
    "RecoveryAction",
    "DeviceRuntimeError",
    "ApplicationRuntimeError",
    "RecoverableRuntimeError",
    "UnrecoverableRuntimeError",
]


class ModelRuntimeError(Exception):
    """Base class of every error the host runtime raises on purpose."""


class BadRequestError(ModelRuntimeError, ValueError):
    """The caller's input is wrong; the message says what was expected and what was given."""


class PopefError(ModelRuntimeError, ValueError):
    """A PopEF file is damaged, truncated, inconsistent or unsupported.

    The message names the file, the blob and the byte offset where known.
    """

    def __init__(self, message: str, *, path: str | None = None, blob: str | None = None,
                 offset: int | None = None) -> None:
        parts = []
        if path is not None:
            parts.append(f"file {path!r}")
        if blob is not None:
            parts.append(f"blob {blob}")
        if offset is not None:
            parts.append(f"offset {offset}")
        where = (" [" + ", ".join(parts) + "]") if parts else ""
        super().__init__(message + where)
        self.path = path
        self.blob = blob
        self.offset = offset


class ModelRuleError(PopefError):
    """A model's files are readable but disagree: metadata, anchors and programs break
    a rule of ``ipu_emulator.validate`` (named by ``rule``, e.g. ``"stream-count"``)."""

    def __init__(self, message: str, *, rule: str, path: str | None = None,
                 blob: str | None = None, offset: int | None = None) -> None:
        super().__init__(message, path=path, blob=blob, offset=offset)
        self.rule = rule


class InvalidStateError(ModelRuntimeError, RuntimeError):
    """The object is closed, stopped or not bound; the call cannot proceed."""


class ForkedProcessError(InvalidStateError):
    """An object was used in a process other than the one that created it (after
    ``fork()``). Its rings, IPU processes and attachments belong to the creator: the
    child must create its own (after the fork), or use the 'spawn' start method.

    ``owner_pid`` is the creating process, ``pid`` the process that used it."""

    def __init__(self, message: str, *, owner_pid: int, pid: int) -> None:
        super().__init__(message)
        self.owner_pid = owner_pid
        self.pid = pid

    def __reduce__(self) -> tuple[object, ...]:
        return (_forked_error, (str(self), self.owner_pid, self.pid))


def _forked_error(message: str, owner_pid: int, pid: int) -> ForkedProcessError:
    return ForkedProcessError(message, owner_pid=owner_pid, pid=pid)


class SharedMemoryFullError(ModelRuntimeError, MemoryError):
    """/dev/shm cannot hold the rings or regions a model needs; the message says how many
    bytes were asked for (and for which ring or anchor) and what /dev/shm has."""


class ResourceLimitError(ModelRuntimeError, OSError):
    """An operating-system limit stopped the runtime creating a ring, region, semaphore
    or IPU process: out of file descriptors (the message gives RLIMIT_NOFILE's soft and
    hard values and how many are open) or the file-size limit RLIMIT_FSIZE (its values
    and the bytes asked). ``__cause__`` is the ``shm`` error that named it."""


class DeviceUnavailableError(ModelRuntimeError, RuntimeError):
    """No device matching the request could be attached."""


class PartitionError(DeviceUnavailableError):
    """The V-IPU partition this process was given cannot serve the request;
    ``partition`` is its name (``docs/vipu.md``)."""

    def __init__(self, message: str, *, partition: str = "") -> None:
        super().__init__(message)
        self.partition = partition


class PartitionNotFoundError(PartitionError):
    """The partition does not exist on the daemon (create it with ``ipu-emulator vipu
    create partition NAME --size N``)."""


class PartitionTooSmallError(PartitionError):
    """The request needs more IPUs (or another device size) than the partition offers."""


class PartitionBusyError(PartitionError):
    """The partition's IPUs are held by another process (another job)."""


class DeviceLostError(ModelRuntimeError, RuntimeError):
    """An emulated IPU process died or stopped answering."""


class SequenceMismatchError(DeviceLostError):
    """A transfer read from a device's output stream carries the sequence number of
    another transfer than the one expected: the replica's streams are out of step, so
    no result of it can be trusted. The replica fails as a lost device does (restarted
    by ``auto_reset``). ``expected`` and ``got`` are the two numbers."""

    def __init__(self, message: str, *, expected: int = 0, got: int = 0) -> None:
        super().__init__(message)
        self.expected = expected
        self.got = got

    def __reduce__(self) -> tuple[object, ...]:
        return (_sequence_error, (str(self), self.expected, self.got))


def _sequence_error(message: str, expected: int, got: int) -> SequenceMismatchError:
    return SequenceMismatchError(message, expected=expected, got=got)


class DeviceTimeoutError(ModelRuntimeError, TimeoutError):
    """A wait on a device, or on data the device needs, timed out."""


class DeviceExecutionError(ModelRuntimeError, RuntimeError):
    """A program failed on the device. ``__cause__`` is a RemoteTraceback."""


class PackageHashMismatchError(ModelRuntimeError, RuntimeError):
    """The executable's package hash differs from the runtime's."""


class RemoteTraceback(Exception):
    """Carries the text of a traceback from another process (as concurrent.futures does)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


class RecoveryAction(enum.Enum):
    """What a ``RecoverableRuntimeError`` needs done before the device runs again
    (Poplar's ``poplar::RecoveryAction``)."""

    IPU_RESET = "IPU_RESET"
    """Reset the IPU and reload the executable (``auto_reset`` does it)."""
    LINK_RESET = "LINK_RESET"
    """Reset the IPU-Links between the IPUs of the device."""
    PARTITION_RESET = "PARTITION_RESET"
    """Reset every IPU of the partition (the device)."""
    FULL_RESET = "FULL_RESET"
    """Reset the whole system: close the runner and make a new one."""


class DeviceRuntimeError(ModelRuntimeError, RuntimeError):
    """Base of Poplar's runtime error classes (``ApplicationRuntimeError``,
    ``RecoverableRuntimeError``, ``UnrecoverableRuntimeError``): the device failed the way
    a real IPU does. ``ipu`` describes the IPU, ``replica`` the replica (None outside a
    ModelRunner), ``program`` the program index (None if unknown)."""

    def __init__(self, message: str, *, ipu: str = "", replica: int | None = None,
                 program: int | None = None) -> None:
        super().__init__(message)
        self.ipu = ipu
        self.replica = replica
        self.program = program

    def _fields(self) -> dict[str, object]:
        return {"ipu": self.ipu, "replica": self.replica, "program": self.program}

    def copy_with(self, message: str, **changes: object) -> "DeviceRuntimeError":
        """The same error (class, fields) with another message and ``changes``."""
        fields = dict(self._fields(), **changes)
        return type(self)(message, **fields)  # type: ignore[arg-type]

    def __reduce__(self) -> tuple[object, ...]:
        # the instance's other attributes too (copy.copy of a raised copy keeps them)
        state = {k: v for k, v in self.__dict__.items() if k not in self._fields()}
        return (_device_runtime_error, (type(self), str(self), self._fields()), state or None)


def _device_runtime_error(cls: type[DeviceRuntimeError], message: str,
                          fields: dict[str, object]) -> DeviceRuntimeError:
    return cls(message, **fields)  # type: ignore[arg-type]


class ApplicationRuntimeError(DeviceRuntimeError):
    """The program failed on the device (Poplar's ``application_runtime_error``); with
    ``auto_reset`` the IPU is reset before the next inference."""


class RecoverableRuntimeError(DeviceRuntimeError):
    """The device failed in a way ``recovery_action`` recovers from (Poplar's
    ``recoverable_runtime_error``); ``auto_reset`` does ``IPU_RESET`` only."""

    def __init__(self, message: str, *, recovery_action: RecoveryAction = RecoveryAction.IPU_RESET,
                 ipu: str = "", replica: int | None = None, program: int | None = None) -> None:
        super().__init__(message, ipu=ipu, replica=replica, program=program)
        self.recovery_action = RecoveryAction(recovery_action)

    def _fields(self) -> dict[str, object]:
        return dict(super()._fields(), recovery_action=self.recovery_action)


class UnrecoverableRuntimeError(DeviceRuntimeError):
    """The device cannot be recovered (Poplar's ``unrecoverable_runtime_error``): close the
    runner (or session and device) and make a new one."""

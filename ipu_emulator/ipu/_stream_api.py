"""What the interpreter's programs read and write streams through: the ``StreamIO``
protocol (and its zero-copy extension, ``ZeroCopyStreamIO``, with the ``ZeroCopyGroup``
a ``StreamIO`` may run in one call), and ``CallableStreamIO`` over Python callables.

The IPU process implements them over rings (``ipu_emulator.ipu._stream_io``); the
interpreter's module docstring draws how a program uses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

__all__ = ["CallableStreamIO", "Step", "StreamIO", "ZeroCopyGroup", "ZeroCopyStreamIO"]

Step = Callable[["StreamIO"], None]
"""One compiled instruction (or fused run of them): called with the program's StreamIO."""


class StreamIO(Protocol):
    """Where the device's streams come from and go to."""

    def read_input(self, handle: str, dest: memoryview) -> None:
        """Fill ``dest`` (exactly one transfer, ``len(dest)`` bytes) from stream ``handle``."""

    def write_output(self, handle: str, src: memoryview) -> None:
        """Consume one transfer of stream ``handle`` from ``src`` (valid during the call)."""


class ZeroCopyStreamIO(StreamIO, Protocol):
    """A ``StreamIO`` that lends its transfer buffers (optional; see the module docstring).

    For one handle, calls alternate ``acquire_input``/``release_input`` (or
    ``acquire_output``/``publish_output``); a program that fails in between may
    leave an output acquired, and then acquires it again.
    """

    def acquire_input(self, handle: str, nbytes: int) -> memoryview:
        """The next transfer of input ``handle``: ``nbytes`` bytes, valid until release."""

    def release_input(self, handle: str) -> None:
        """Done with the transfer ``acquire_input(handle)`` returned."""

    def acquire_output(self, handle: str, nbytes: int) -> memoryview:
        """A writable buffer of ``nbytes`` bytes for the next transfer of output ``handle``."""

    def publish_output(self, handle: str) -> None:
        """The buffer of ``acquire_output(handle)`` holds the transfer: send it."""


@dataclass(eq=False)
class ZeroCopyGroup:
    """The zero-copy ``StreamIn``s, the ``Execute`` and the ``StreamOut``s of one run.

    A ``StreamIO`` may have ``run_group(group) -> bool``: do the whole run at
    once (acquire one transfer of each input and a buffer of each output, call
    ``fn(*args)`` for ``calls[(input addresses..., output addresses...)] ==
    (binding, fn, args)``, publish the outputs, release the inputs) and return
    True; or do nothing and return False (the steps then run one by one, and
    they add the missing ``calls`` entry). It raises only what ``fn`` raised.
    """

    in_handles: tuple[str, ...]
    in_sizes: tuple[int, ...]
    out_handles: tuple[str, ...]
    out_sizes: tuple[int, ...]
    calls: dict[tuple[int, ...], tuple[Any, Callable[..., Any], tuple[Any, ...]]] = field(
        default_factory=dict)


class CallableStreamIO:
    """A ``StreamIO`` over dicts of per-handle callables (tests, in-process stand-ins).

    ``inputs[handle](dest)`` fills ``dest``; ``outputs[handle](src)`` consumes ``src``.
    """

    def __init__(self, inputs: dict[str, Callable[[memoryview], None]] | None = None,
                 outputs: dict[str, Callable[[memoryview], None]] | None = None) -> None:
        self.inputs = dict(inputs or {})
        self.outputs = dict(outputs or {})

    def read_input(self, handle: str, dest: memoryview) -> None:
        try:
            fn = self.inputs[handle]
        except KeyError:
            raise KeyError(f"no input callable for stream {handle!r}; have "
                           f"{sorted(self.inputs)}") from None
        fn(dest)

    def write_output(self, handle: str, src: memoryview) -> None:
        try:
            fn = self.outputs[handle]
        except KeyError:
            raise KeyError(f"no output callable for stream {handle!r}; have "
                           f"{sorted(self.outputs)}") from None
        fn(src)

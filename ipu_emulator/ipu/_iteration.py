"""One description of a Main iteration's transfers, which every way of running it executes.

A Main iteration of the IPU process (StreamIns, one Execute, StreamOuts) runs
one of three ways:

- the copy path: the interpreter copies each transfer between a ring slot and
  device memory (``_RingIO.read_input`` / ``write_output``);
- the zero-copy path: onnxruntime reads the input slots and writes the output
  slots in place (``_RingIO.acquire_input`` ... ``publish_output``);
- the fused C step: ``ipu_emulator/ipu/_stepcore.c`` does the whole
  iteration in one C call when every transfer is there at once
  (``_RingIO.run_group`` / ``run_groups``).

Which streams take the zero-copy path is decided once per executable, at load,
by :func:`ipu_emulator.ipu._zerocopy.plan_zero_copy`. Everything else a
transfer is subject to is said here, once, and the three ways follow it:

- the sequence number (``ipu_protocol``: a tag is ``kind | seq << SEQ_SHIFT``):
  every input of one iteration carries the same number (0, a callback's
  transfer, agrees with any), else the iteration fails with a PROTOCOL error
  naming both numbers; every output of the iteration (output rings, link rings
  to the next IPU) is tagged with it (:class:`IterationNumber`).
- :data:`INPUT_TAGS`: what an input slot's tag kind means (:class:`InAction`): the
  transfer is in the slot; the slot holds a host-memory descriptor (the input
  is read where the host has it, and the outputs the descriptor names are
  written into host memory: "redirected"); the host could not produce it.
- :data:`OUTPUT_TAGS`: how an output is published (:class:`OutAction`): its
  bytes in a slot, or an empty slot saying it is in host memory.
- :class:`StreamPlan`: what one stream does in its mode (computed when the
  session's streams are attached, and again when their modes change): nothing
  (null), a NEED event before waiting for an input, an OUT event after each
  output, whether the C step may serve it, whether to poll for it first.
- :func:`make_step`: the same, as data for the C step: per input, the
  ``(tag, action)`` pairs it may do in C; per output, its key in the
  descriptor table and its two tags. The C code executes that plan and
  decides nothing (a tag it was not given, e.g. an abort, sends the iteration
  back to the Python path, which applies :data:`INPUT_TAGS`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ipu_emulator.executable import is_sync
from ipu_emulator.trace import recorder
from ipu_emulator.ipu_protocol import (MODE_DIRECT, MODE_EVENT, MODE_NULL, SEQ_SHIFT, TAG_ABORT,
                                       TAG_DATA, TAG_KIND_MASK, TAG_SHARED)

try:
    import ipu_emulator.ipu._stepcore as _stepcore_module
    _stepcore: Any = _stepcore_module
except ImportError:   # built without the C extensions: iterations run in Python
    _stepcore = None

__all__ = ["InAction", "OutAction", "INPUT_TAGS", "OUTPUT_TAGS", "SLOT_TAG", "HOST_TAG",
           "IterationNumber", "SequenceMismatch", "StreamPlan", "c_accepts", "input_action",
           "make_step", "numbered", "plan_stream"]


class InAction(enum.IntEnum):
    """What an input slot is, by its tag."""

    SLOT = 1    # the transfer is the slot's payload (exactly one transfer of bytes)
    HOST = 2    # the payload is a host-memory descriptor: read the input there, and
                # write the outputs it names into host memory (see _host_memory)
    ABORT = 3   # the host could not produce the input: the request fails


class _InputTags(dict[int, InAction]):
    def __missing__(self, tag: int) -> InAction:
        return InAction.SLOT   # any other tag: a plain transfer


INPUT_TAGS: dict[int, InAction] = _InputTags({TAG_DATA: InAction.SLOT,
                                              TAG_SHARED: InAction.HOST,
                                              TAG_ABORT: InAction.ABORT})
"""Slot tag -> what it means; ``INPUT_TAGS[tag]`` of any other tag is ``InAction.SLOT``
(a plain transfer)."""


class OutAction(enum.IntEnum):
    """How an output transfer reaches the host."""

    SLOT = 1    # its bytes in a slot
    HOST = 2    # written into the host memory a descriptor named; an empty slot says so


OUTPUT_TAGS: dict[OutAction, int] = {OutAction.SLOT: TAG_DATA, OutAction.HOST: TAG_SHARED}
"""How each kind of output is tagged when published."""

SLOT_TAG = OUTPUT_TAGS[OutAction.SLOT]
HOST_TAG = OUTPUT_TAGS[OutAction.HOST]


def numbered(handle: str) -> bool:
    """Whether the outputs of stream ``handle`` carry the iteration's number: all but the
    sharding token (``is_sync``), which the last IPU of an iteration sends to the first
    for the next one (and the host once, unnumbered)."""
    return not is_sync(handle)


def input_action(tag: int) -> InAction:
    """What an input slot tagged ``tag`` holds (by the tag's kind)."""
    return INPUT_TAGS[tag & TAG_KIND_MASK]


class SequenceMismatch(Exception):
    """Inputs of one iteration carry the numbers of two transfers."""


class IterationNumber:
    """The sequence number of the iteration in progress on the Python path.

    An iteration starts with the first input read after an output (or at the start);
    ``take(tag)`` returns the tag's kind and checks its number against the iteration's;
    ``tag(kind)`` is an output's tag; ``ended()`` after a C step did a whole iteration;
    ``stepped(seq, outputs)`` after a C step did part of one (a group of it: the other
    streams of the iteration, on the Python path, carry its number ``seq``).
    """

    __slots__ = ("seq", "reading", "begun")

    def __init__(self) -> None:
        self.seq = 0          # the iteration's number (0: none yet)
        self.reading = False  # inputs of the iteration are being read (no output yet)
        self.begun = False    # a transfer of the program run went in or out (a timeline's
                              # run begins there: ``_RingIO.run_began``)

    def take(self, tag: int, handle: str) -> int:
        n = tag >> SEQ_SHIFT
        self.begun = True
        if not self.reading:
            self.reading = True
            self.seq = n
        elif n and n != self.seq:
            if self.seq:
                raise SequenceMismatch(
                    f"input stream {handle!r} holds transfer {n}, the other inputs of this "
                    f"iteration are transfer {self.seq}: the host's input streams are out of "
                    "step")
            self.seq = n
        return tag & TAG_KIND_MASK

    def tag(self, kind: int) -> int:
        """The tag of an output of this iteration (which ends its reading)."""
        self.reading = False
        self.begun = True
        return kind | self.seq << SEQ_SHIFT

    def current(self) -> int:
        """The number the iteration has so far (0: none), for the C step."""
        return self.seq if self.reading else 0

    def ended(self) -> None:
        self.reading = False

    def stepped(self, seq: int, outputs: bool) -> None:
        self.seq = seq
        self.reading = not outputs   # a step of inputs only: the reading goes on
        self.begun = True


@dataclass(frozen=True)
class StreamPlan:
    """What one stream does with its transfers, in its mode."""

    null: bool         # no transfers: an input reads as zeros, an output is dropped
    need_event: bool   # post NEED before waiting for an input transfer
    out_event: bool    # post OUT after publishing an output transfer
    c_step: bool       # the C step may serve it (it never waits and posts no event)
    poll: bool         # an input the IPU polls for before a C step (nobody is told it waits)


def plan_stream(direction: str, mode: int) -> StreamPlan:
    """The plan of a stream of ``direction`` ("in"/"out") in ``mode`` (protocol.MODE_*)."""
    null = mode == MODE_NULL
    need_event = direction == "in" and mode == MODE_EVENT
    out_event = direction == "out" and mode == MODE_EVENT
    # An input's NEED is posted only before a wait, and a C step never waits; an output's
    # OUT follows each publish, which the C step does not post.
    c_step = not null and not out_event
    poll = direction == "in" and mode == MODE_DIRECT
    return StreamPlan(null, need_event, out_event, c_step, poll)


# The input actions the C step does, as its codes (the others go back to Python).
_C_ACTIONS: dict[InAction, int] = (
    {InAction.SLOT: _stepcore.IN_SLOT, InAction.HOST: _stepcore.IN_TABLE}
    if _stepcore is not None else {})


def c_accepts() -> tuple[tuple[int, int], ...]:
    """:data:`INPUT_TAGS` as the C step's (tag, action code) pairs, for the actions it
    does (a tag not listed, e.g. an abort or a tag outside the table, goes to Python)."""
    return tuple((tag, _C_ACTIONS[a]) for tag, a in INPUT_TAGS.items() if a in _C_ACTIONS)


def make_step(inputs: Sequence[tuple[Any, int, StreamPlan]],
              outputs: Sequence[tuple[Any, int, str, StreamPlan]],
              table: dict[bytes, Any], calls: dict[tuple[int, ...], Any]
              ) -> tuple[Any, Callable[[], bool] | None] | None:
    """The C step of one iteration and its inputs-there test (None: do not poll), or None
    when the Python path has to serve it (no C extension, a ring without a C handle, a
    stream the plan keeps off the C step, a transfer larger than its slots).

    ``inputs``: (ring, transfer bytes, plan) per input; ``outputs``: (ring, transfer
    bytes, handle, plan) per output, ``handle`` being how host-memory descriptors name
    the output; ``table``: resolved descriptors (``HostMemory.resolved``); ``calls``: the
    group's bound runs (``ZeroCopyGroup.calls``).
    """
    if _stepcore is None:
        return None
    if not all(i[2].c_step for i in inputs) or not all(o[3].c_step for o in outputs):
        return None
    accepts = c_accepts()
    ins = []
    for ring, nbytes, _ in inputs:
        h = ring.c_handle()
        if h is None:
            return None
        ins.append((h, nbytes, accepts))
    outs = []
    for ring, nbytes, handle, _ in outputs:
        h = ring.c_handle()
        if h is None:
            return None
        outs.append((h, nbytes, handle, SLOT_TAG, HOST_TAG, numbered(handle)))
    try:
        step = _stepcore.Step(tuple(ins), tuple(outs), table, calls, SEQ_SHIFT)
    except (TypeError, ValueError):   # e.g. a transfer larger than its slots
        return None
    trace = recorder.buffer() if recorder.ON else None
    if trace is not None:   # each step a record of the timeline (ipu_emulator.trace)
        step.trace(trace.buf, recorder.I_STEP)
    inputs_there = None
    if inputs and all(i[2].poll for i in inputs):
        inputs_there = _all_readable([i[0].readable for i in inputs])
    return step, inputs_there


def _all_readable(readable: list[Callable[[], int]]) -> Callable[[], Any]:
    """A test that every one of ``readable`` is true, as cheap as it gets: _poll calls it
    in its loop (``all()`` over a generator costs ~1 us, ``a() and b()`` ~0.15 us)."""
    if len(readable) == 1:
        return readable[0]
    if len(readable) == 2:
        first, second = readable
        return lambda: first() and second()

    def there() -> bool:
        for f in readable:
            if not f():
                return False
        return True
    return there

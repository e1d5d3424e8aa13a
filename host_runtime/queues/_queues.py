"""Queues of user memory between an application and a session's streams.

Seed 002 sections 10.2.2-10.2.3. The picture, for one input anchor::

    application thread                      stream servicing (session)
    ------------------                      --------------------------
    InputQueue.enqueue(ptr, n)  --write-->  SpscRingBuffer[InputData]  --readLock-->
                                                      InputQueue.fill(slot)
                                            packs/splits items into whole
                                            transfers of the anchor's size
                                            and copies them into the slot

and the mirror image for outputs (``OutputQueue.drain(slot)`` splits one
transfer produced by the device across the ``OutputData`` items the
application enqueued). Queues hold *references* to user memory (the seed's
pointers): the data is copied once, straight between user memory and the
stream slot.

``flush()`` enqueues a marker. When ``fill`` reaches it, it pads the
transfer being built with zeros, or produces a whole dummy transfer if none
is being built; when ``drain`` reaches the matching output marker it discards
the rest of the transfer (or a whole dummy transfer). Enqueue flushes on the
input and output queues in the same order and the two stay in step.

``SpscRingBuffer`` is an in-process ring of fixed slots with one producer and
one consumer thread; blocking calls return early once it is invalidated, so
always check ``isValid()`` after ``writeLock()``/``readLock()``.
"""

from __future__ import annotations

import abc
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterable, Optional, Protocol, TypeVar, cast

import numpy as np

from shm import describe_process

from host_runtime._fork import check_owner, current_pid
from host_runtime.queues._spsc import SpscRingBuffer
from host_runtime.errors import BadRequestError, InvalidStateError
from host_runtime.popef.model import Anchor, Model, TensorInfo, TensorType

__all__ = [
    "SpscRingBuffer",
    "InputRingBuffer",
    "OutputRingBuffer",
    "InputData",
    "OutputData",
    "IQueue",
    "InputQueue",
    "OutputQueue",
    "QueueManager",
    "IMemoryPool",
    "RingMemoryPool",
    "allocateQueueStorage",
    "ring_size_multiplier_factory",
    "RingSizeMultiplierProdType",
    "ReadStartCallback",
    "ReadCompleteCallback",
    "WriteCompleteCallback",
]

_log = logging.getLogger(__name__)

ReadStartCallback = Callable[[], None]
"""Called just before the first bytes of an ``InputData`` item are copied into a transfer."""
ReadCompleteCallback = ReadStartCallback
"""Called when the last bytes of an ``InputData`` item have been copied into a transfer."""
WriteCompleteCallback = Callable[[], None]
"""Called after the last bytes of a transfer have been written into an ``OutputData`` item."""
RingSizeMultiplierProdType = Callable[[Anchor], int]
"""``anchor -> multiplier`` of its ring size (see ``ring_size_multiplier_factory``)."""
_U8 = np.dtype(np.uint8)


# --------------------------------------------------------------------------- items
class _FlushMarker:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<flush>"


_FLUSH = _FlushMarker()

# ``data`` of an item is the application's memory (the seeds' pointer): whatever it
# enqueued, a numpy array or any bytes-like object (``_bytes_of`` turns it into a flat
# uint8 view on enqueue), or the flush marker. Hence ``Any``.


@dataclass
class InputData:
    """One item of an input queue: a reference to user bytes plus callbacks."""

    data: Any = None
    data_size: int = 0
    readStartCallback: Optional[ReadStartCallback] = None
    readCompleteCallback: Optional[ReadCompleteCallback] = None


@dataclass
class OutputData:
    """One item of an output queue: where to write, how much, and a callback."""

    data: Any = None
    data_size: int = 0
    writeCompleteCallback: Optional[WriteCompleteCallback] = None


class InputRingBuffer(SpscRingBuffer[InputData]):
    def __init__(self, num_buffers: int, label: str,
                 timeout_cb: Optional[Callable[[SpscRingBuffer[InputData]], None]] = None,
                 timeout_ns: int = 0, *, peer: Optional[Callable[[], str]] = None) -> None:
        super().__init__(num_buffers, label, timeout_cb, timeout_ns, factory=InputData,
                         peer=peer)


class OutputRingBuffer(SpscRingBuffer[OutputData]):
    def __init__(self, num_buffers: int, label: str,
                 timeout_cb: Optional[Callable[[SpscRingBuffer[OutputData]], None]] = None,
                 timeout_ns: int = 0, *, peer: Optional[Callable[[], str]] = None) -> None:
        super().__init__(num_buffers, label, timeout_cb, timeout_ns, factory=OutputData,
                         peer=peer)


def _bytes_of(data: Any, size: int, writable: bool, what: str) -> np.ndarray:
    """A flat uint8 numpy view of the first ``size`` bytes of ``data`` (no copy)."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise BadRequestError(f"{what}: memory must be C-contiguous")
        flat = data.reshape(-1).view(_U8)
    else:
        try:
            mv = memoryview(data)
        except TypeError:
            raise BadRequestError(
                f"{what}: expected a numpy array or a bytes-like object, "
                f"got {type(data).__name__}") from None
        flat = np.frombuffer(mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv, _U8)
    if writable and not flat.flags.writeable:
        raise BadRequestError(f"{what}: expected writable memory, got read-only memory")
    if size > flat.nbytes:
        raise BadRequestError(
            f"{what}: data_size {size} bytes exceeds the buffer's {flat.nbytes} bytes")
    return flat[:size]


def _nbytes(data: Any) -> int:
    if isinstance(data, np.ndarray):
        return int(data.nbytes)
    try:
        return memoryview(data).nbytes
    except TypeError:
        raise BadRequestError(
            f"expected a numpy array or a bytes-like object, got {type(data).__name__}") from None


# --------------------------------------------------------------------------- queues
class IQueue(abc.ABC):
    """What every queue offers: its tensor, its capacity, and disconnection."""

    @abc.abstractmethod
    def tensorInfo(self) -> TensorInfo: ...

    @abc.abstractmethod
    def numBuffers(self) -> int: ...

    @abc.abstractmethod
    def disconnect(self) -> None: ...


def _sample_size(info: TensorInfo) -> int:
    shape = info.shape()
    total = info.sizeInBytes()
    if shape and shape[0] > 0:
        return total // shape[0]
    return total


_Item = TypeVar("_Item", bound="InputData | OutputData")
_Q = TypeVar("_Q")


class _QueueBase(IQueue, Generic[_Item]):
    def __init__(self, buffer: SpscRingBuffer[_Item], info: TensorInfo,
                 name: str | None = None) -> None:
        """The reference's ``InputQueue(buffer, info)`` / ``OutputQueue(buffer, info)``:
        ``buffer`` the ring, ``info`` the tensor; ``name`` (for messages) defaults to the
        ring's label."""
        if not isinstance(buffer, SpscRingBuffer):
            raise BadRequestError(f"{type(self).__name__}: buffer must be an SpscRingBuffer, "
                                  f"got {type(buffer).__name__}")
        if not isinstance(info, TensorInfo):
            raise BadRequestError(f"{type(self).__name__}: info must be a popef TensorInfo, "
                                  f"got {type(info).__name__}")
        if name is None:
            name = buffer.label()
        self._rb: SpscRingBuffer[_Item] = buffer
        self._info = info
        self._name = name
        self._transfer = info.sizeInBytes()
        self._sample = max(1, _sample_size(info))
        self._current: _Item | None = None   # the item being consumed across transfers
        self._pos = 0               # bytes of it already consumed
        self._state_lock = threading.Lock()
        # Its consumer is the session's stream service of this process: in a forked child
        # nothing would ever take what is queued (see host_runtime._fork).
        self._owner_pid = current_pid()

    def _check_owner(self) -> None:
        check_owner(self._owner_pid, f"{self._KIND} {self._name!r}")

    def tensorInfo(self) -> TensorInfo:
        return self._info

    def numBuffers(self) -> int:
        return self._rb.numBuffers()

    def name(self) -> str:
        return self._name

    def ringBuffer(self) -> SpscRingBuffer[_Item]:
        return self._rb

    def enqueueLock(self) -> _Item:
        """Lock an item for writing (blocking); fill it and call enqueueComplete()."""
        self._check_owner()
        return self._rb.writeLock()

    # The application's buffers: read by InputQueue, written by OutputQueue.
    _WRITABLE = False
    _KIND = "queue"

    def enqueueComplete(self) -> None:
        """Unlock the item locked by enqueueLock(); its size must be whole samples."""
        self._check_owner()
        item = self._rb.writeLocked() if self._rb.isValid() else None
        if item is not None and item.data is not _FLUSH:
            try:
                self._check_size(int(item.data_size))
                item.data = _bytes_of(item.data, int(item.data_size), self._WRITABLE,
                                      f"{self._KIND} {self._name!r}")
            except BadRequestError:
                self._rb.writeAbort()
                raise
        self._rb.writeComplete()

    def disconnect(self) -> None:
        self._check_owner()
        self._rb.invalidate()

    def reset(self) -> None:
        """Empty the queue and make it valid again (after the session stopped)."""
        self._check_owner()
        self._rb.reset()
        self._current = None
        self._pos = 0

    def flush(self) -> None:
        self._check_owner()
        item = self._rb.writeLock()
        if not self._rb.isValid():
            return
        item.data = _FLUSH
        item.data_size = 0
        self._clear_callbacks(item)
        self._rb.writeComplete()

    @staticmethod
    @abc.abstractmethod
    def _clear_callbacks(item: _Item) -> None:
        """Unset the callbacks of a reused ring item."""

    def _check_size(self, size: int) -> None:
        if size <= 0 or size % self._sample:
            raise BadRequestError(
                f"queue {self._name!r}: data_size must be a positive multiple of one sample "
                f"({self._sample} bytes of {self._info!r}), got {size}")


class InputQueue(_QueueBase[InputData]):
    """Packs or splits what the application enqueues into whole transfers."""

    _WRITABLE = False
    _KIND = "input queue"

    @staticmethod
    def _clear_callbacks(item: InputData) -> None:
        item.readStartCallback = None
        item.readCompleteCallback = None

    def enqueue(self, input: Any, data_size: int | None = None,
                read_start_callback: Optional[ReadStartCallback] = None,
                read_complete_callback: Optional[ReadCompleteCallback] = None) -> None:
        """Queue a reference to ``data_size`` bytes of ``input`` (not copied)."""
        self._check_owner()
        size = _nbytes(input) if data_size is None else int(data_size)
        self._check_size(size)
        flat = _bytes_of(input, size, False, f"input queue {self._name!r}")
        self._rb.write(InputData(flat, size, read_start_callback, read_complete_callback))

    # -- consumer side: the stream callback -----------------------------------
    def fill(self, dest: Any) -> bool:
        """Fill one transfer into ``dest`` (a writable buffer of the anchor's size).

        Blocks until enough data (or a flush marker) is queued. Returns False,
        leaving ``dest`` zeroed, if the queue was disconnected meanwhile.

        All or nothing: if a user callback (read start / read complete) raises, the
        transfer fails (the exception propagates: the device is told the input could
        not be made) and takes nothing from the queue: the items it read are read again
        by the next transfer (and their callbacks called again), so the queues of the
        other anchors stay paired with this one. The items a transfer used up are
        freed once it is whole (one transfer never needs more items than the queue
        holds: an item is at least one sample).
        """
        out = _bytes_of(dest, self._transfer, True, f"stream slot of {self._name!r}")
        off = 0
        T = self._transfer
        rb = self._rb
        entry = (self._current, self._pos)
        locked = 0      # items this transfer read-locked
        used = 0        # items it used up (freed when it is whole)
        try:
            while off < T:
                item = self._current
                if item is None:
                    item = rb.readLock()
                    if not rb.isValid():
                        out[off:] = 0
                        return False
                    locked += 1
                    if item.data is _FLUSH:
                        out[off:] = 0
                        used += 1
                        break
                    self._current = item
                    self._pos = 0
                    if item.readStartCallback is not None:
                        item.readStartCallback()
                n = min(T - off, item.data_size - self._pos)
                out[off:off + n] = item.data[self._pos:self._pos + n]
                off += n
                self._pos += n
                if self._pos >= item.data_size:
                    self._current = None
                    self._pos = 0
                    used += 1
                    if item.readCompleteCallback is not None:
                        item.readCompleteCallback()
        except BaseException:
            self._current, self._pos = entry
            if rb.isValid():
                rb.readUnlock(locked)
            raise
        for _ in range(used):
            rb.readComplete()
        return True

    __call__ = fill


class OutputQueue(_QueueBase[OutputData]):
    """Splits each transfer the device produces across the application's buffers."""

    _WRITABLE = True
    _KIND = "output queue"

    @staticmethod
    def _clear_callbacks(item: OutputData) -> None:
        item.writeCompleteCallback = None

    def enqueue(self, output: Any, data_size: int | None = None,
                write_complete_callback: Optional[WriteCompleteCallback] = None) -> None:
        """Queue a reference to where the next ``data_size`` output bytes go."""
        self._check_owner()
        size = _nbytes(output) if data_size is None else int(data_size)
        self._check_size(size)
        flat = _bytes_of(output, size, True, f"output queue {self._name!r}")
        self._rb.write(OutputData(flat, size, write_complete_callback))

    def drain(self, src: Any) -> bool:
        """Distribute one transfer from ``src`` to the queued output buffers.

        Blocks until enough buffers (or a flush marker) are queued. Returns False
        if the queue was disconnected meanwhile (the data is dropped).

        The whole transfer is always distributed: a write complete callback that raises
        does not stop it (the first such exception is raised once the transfer is
        out), so the next transfer goes to the next buffers.
        """
        data = _bytes_of(src, self._transfer, False, f"stream slot of {self._name!r}")
        off = 0
        T = self._transfer
        rb = self._rb
        failed: BaseException | None = None
        while off < T:
            item = self._current
            if item is None:
                item = rb.readLock()
                if not rb.isValid():
                    return False
                if item.data is _FLUSH:
                    rb.readComplete()
                    break
                self._current = item
                self._pos = 0
            n = min(T - off, item.data_size - self._pos)
            item.data[self._pos:self._pos + n] = data[off:off + n]
            off += n
            self._pos += n
            if self._pos >= item.data_size:
                self._current = None
                self._pos = 0
                rb.readComplete()
                if item.writeCompleteCallback is not None:
                    try:
                        item.writeCompleteCallback()
                    except Exception as exc:   # raised once the transfer is out
                        if failed is None:
                            failed = exc
        if failed is not None:
            try:
                raise failed
            finally:   # (this frame holding the error it raised: a reference cycle)
                del failed
        return True

    __call__ = drain


# --------------------------------------------------------------------------- pools
class IMemoryPool(abc.ABC):
    """A common interface for memory allocators that back queues."""

    @abc.abstractmethod
    def blobSize(self) -> int: ...

    @abc.abstractmethod
    def getMemoryBlob(self) -> np.ndarray: ...


class RingMemoryPool(IMemoryPool):
    """``num_blobs`` blobs of ``blob_size`` bytes, handed out round-robin."""

    def __init__(self, blob_size: int, num_blobs: int) -> None:
        if int(blob_size) < 0 or int(num_blobs) < 1:
            raise BadRequestError(
                f"RingMemoryPool: expected blob_size >= 0 and num_blobs >= 1, "
                f"got blob_size={blob_size}, num_blobs={num_blobs}")
        self._blob = int(blob_size)
        self._num = int(num_blobs)
        self._memory = np.zeros(self._blob * self._num, dtype=_U8)
        self._next = 0
        self._lock = threading.Lock()

    def numBlobs(self) -> int:
        return self._num

    def blobSize(self) -> int:
        return self._blob

    def getMemoryBlob(self) -> np.ndarray:
        """The next blob (a writable uint8 array); wraps round at the end."""
        with self._lock:
            i = self._next
            self._next = (i + 1) % self._num
        return self._memory[i * self._blob:(i + 1) * self._blob]


def allocateQueueStorage(queue: IQueue, extra_buffers: int = 0) -> RingMemoryPool:
    """A memory pool large enough to back ``queue`` (plus ``extra_buffers``)."""
    return RingMemoryPool(queue.tensorInfo().sizeInBytes(), queue.numBuffers() + int(extra_buffers))


class ring_size_multiplier_factory:
    """Factories of ``RingSizeMultiplierProdType`` functions (anchor -> multiplier)."""

    @staticmethod
    def ringSizeMultForProgs(programs: Iterable[int], selected_ring_size_multiplier: int,
                             others_ring_size_multiplier: int = 1) -> RingSizeMultiplierProdType:
        progs = frozenset(int(p) for p in programs)
        sel = int(selected_ring_size_multiplier)
        oth = int(others_ring_size_multiplier)

        def multiplier(anchor: Anchor) -> int:
            return sel if progs.intersection(anchor.programs()) else oth
        return multiplier

    @staticmethod
    def ringSizeMultForMainProgs(model: Model, main_ring_size_multiplier: int,
                                 load_save_ring_size_multiplier: int = 1) -> RingSizeMultiplierProdType:
        return ring_size_multiplier_factory.ringSizeMultForProgs(
            model.metadata.programFlow().main(), main_ring_size_multiplier,
            load_save_ring_size_multiplier)


# --------------------------------------------------------------------------- manager
def _queue_callback(step: Callable[[memoryview], bool], disconnected: str
                    ) -> Callable[[memoryview], None]:
    """A queue's ``fill`` (input) or ``drain`` (output) as a stream callback. A queue
    disconnected before its transfer was whole (the session's stop() or close(), or
    ``disconnect()``) raises an InvalidStateError (``queue_disconnected``, the message
    ``disconnected``), which fails the run as a stop does: an input's zeros are not
    handed to the device (the session aborts the slot: no run computes from them and
    returns as done, its outputs dropped), and no run returns as done with an output
    that reached nobody."""
    def callback(view: memoryview) -> bool:
        if not step(view):
            exc = InvalidStateError(disconnected)
            exc.queue_disconnected = True   # type: ignore[attr-defined]
            try:
                raise exc
            finally:   # (this frame holding the error it raised: a reference cycle)
                del exc
        return True   # (as fill's and drain's; the session ignores it)
    return cast(Callable[[memoryview], None], callback)


class QueueSession(Protocol):
    """What a QueueManager uses of its session (``host_runtime.session.Session``)."""

    def getUserInputAnchors(self) -> list[Anchor]: ...
    def getUserOutputAnchors(self) -> list[Anchor]: ...
    def setCallbackForAnchor(self, anchor_handle: str,
                             callback: Callable[[memoryview], None] | None) -> None: ...


def _describe_device(ref: "weakref.ref[QueueSession]") -> Callable[[], str]:
    """Names the session's device and its IPU processes with their states (for a queue
    whose device side took nothing for the host sync timeout)."""
    def describe() -> str:
        session = ref()
        device = getattr(session, "device", None)   # a Session's; test stand-ins lack it
        dev = device() if callable(device) else None
        if dev is None:
            return "the session is not bound to a device"
        return f"{dev.describe()}: " + ", ".join(
            f"IPU process {describe_process(pid)}" for pid in dev.pids())
    return describe


class QueueManager:
    """Creates an input or output queue per user anchor of a session and binds it.

    ``QueueManager(session, ring_size_multiplier=2, timeout_ns=0,
    timeout_callback=None)``: the ring of each queue holds
    ``multiplier(anchor) * batch`` items (``batch`` = the anchor's first
    dimension), so it can hold that many transfers' worth of single samples.
    ``timeout_callback(queue, ring)`` is called every ``timeout_ns`` while
    the device waits on an empty input queue. Normally created through
    ``Session.createQueueManager(...)``.
    """

    def __init__(self, session: QueueSession, ring_size_multiplier: int | RingSizeMultiplierProdType = 2,
                 timeout_ns: int = 0,
                 timeout_callback: Optional[Callable[["InputQueue", SpscRingBuffer[InputData]], None]] = None
                 ) -> None:
        self._owner_pid = current_pid()   # fork: see host_runtime._fork
        self.inputs: dict[str, InputQueue] = {}
        self.outputs: dict[str, OutputQueue] = {}
        # The session owns its queue managers (createQueueManager): refer back weakly.
        self._session = weakref.ref(session)
        self._by_handle: dict[str, str] = {}
        inputs = self.inputs    # the timeout callbacks hold the queues, not the manager
        peer = _describe_device(self._session)
        mult: RingSizeMultiplierProdType
        if callable(ring_size_multiplier):
            mult = ring_size_multiplier
        else:
            k = int(ring_size_multiplier)
            mult = lambda anchor: k  # noqa: E731
        for anchor in [*session.getUserInputAnchors(), *session.getUserOutputAnchors()]:
            info = anchor.tensorInfo()
            shape = info.shape()
            batch = shape[0] if shape and shape[0] > 0 else 1
            n = max(1, int(mult(anchor))) * batch
            name = anchor.name()
            self._by_handle[anchor.handle()] = name
            if anchor.type() == TensorType.INPUT:
                cb = None
                if timeout_callback is not None and timeout_ns:
                    def cb(rb: SpscRingBuffer[InputData], _n: str = name) -> None:
                        timeout_callback(inputs[_n], rb)
                rb_in = InputRingBuffer(n, name, cb, int(timeout_ns), peer=peer)
                q_in = InputQueue(rb_in, info, name)
                self.inputs[name] = q_in
                session.setCallbackForAnchor(anchor.handle(), _queue_callback(
                    q_in.fill, f"input queue {name!r} was disconnected (the session was "
                    "stopped or closed) before it filled a transfer: the run did not take "
                    "place"))
            else:
                rb_out = OutputRingBuffer(n, name, peer=peer)
                q_out = OutputQueue(rb_out, info, name)
                self.outputs[name] = q_out
                session.setCallbackForAnchor(anchor.handle(), _queue_callback(
                    q_out.drain, f"output queue {name!r} was disconnected (the session was "
                    "stopped or closed) before it took a transfer: that output was dropped"))

    def _resolve(self, name: str, table: dict[str, _Q], kind: str) -> _Q:
        check_owner(self._owner_pid, "QueueManager")
        key = name if name in table else self._by_handle.get(name, name)
        try:
            return table[key]
        except KeyError:
            raise BadRequestError(
                f"no {kind} queue for tensor {name!r}; expected one of "
                + (", ".join(sorted(table)) or "(none)")) from None

    def inputQueue(self, name: str) -> InputQueue:
        return self._resolve(name, self.inputs, "input")

    def outputQueue(self, name: str) -> OutputQueue:
        return self._resolve(name, self.outputs, "output")

    def _all(self) -> list[InputQueue | OutputQueue]:
        check_owner(self._owner_pid, "QueueManager")
        return [*self.inputs.values(), *self.outputs.values()]

    def flushAll(self) -> None:
        for q in self._all():
            q.flush()

    def disconnectAll(self) -> None:
        for q in self._all():
            q.disconnect()

    def resetAll(self) -> None:
        for q in self._all():
            q.reset()

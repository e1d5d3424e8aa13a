"""A session's streams: what feeds or drains each anchor, its ring, and the servicing.

Each input or output anchor of a model is one *stream*, numbered in metadata
order (the index NEED/OUT events carry). For each, the table knows

- its callback: the user's (``setCallbackForAnchor`` and the handlers), else
  the PopEF tensor/feed data bound automatically, else none; the empty
  callback of ``BIND_EMPTY_CB`` is the marker ``EMPTY``;
- whether it is *direct* (claimed by the fast path: the caller moves the
  bytes itself);
- its ring (slot = one transfer of ``sizeInBytes``), created on first bind
  (:mod:`host_runtime.session._rings`).

``on_need`` / ``on_out`` run on the device's service thread (the table is the
link's ``StreamServicer``, :mod:`host_runtime.devices.link`): they call the
callback over a slot of the ring and publish or release it. A callback that
raises is recorded (``take_callback_error``) and, for an input, the slot is
published with ``TAG_ABORT`` so the device fails the program instead of
waiting forever.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

from shm import ShmError
from shm.settings import ShmSettings

from host_runtime import popef
from host_runtime.devices import main_reads, paced
from host_runtime.errors import (BadRequestError, DeviceExecutionError, InvalidStateError,
                                 PopefError)
from host_runtime.session.predicates import (AnchorCallbackPolicy, AnchorCallbackPredicate,
                                     PopefDataUsagePolicy, PopefDataUsagePredicate)
from host_runtime.session._rings import StreamRings, ring_depth
from ipu_emulator.ipu_protocol import MODE_DIRECT, MODE_EVENT, MODE_NULL, TAG_ABORT, LoadStream

__all__ = ["StreamTable", "EMPTY", "Callback", "callback_failure"]

_log = logging.getLogger("host_runtime.session._session")

Callback = Callable[[memoryview], None]

_SERVICE_TIMEOUT = 30.0          # a slot the device announced must be there by then


class _Empty:
    """The empty (dummy) callback of BIND_EMPTY_CB: inputs read zeros, outputs dropped."""

    def __call__(self, view: memoryview) -> None:
        return None

    def __repr__(self) -> str:
        return "<empty callback>"


EMPTY = _Empty()


def _popef_input_callback(data: bytes | memoryview, nbytes: int, transfers: int, what: str) -> Callback:
    """A callback feeding PopEF tensor data (one transfer) or feed data (cycled)."""
    if transfers <= 1:
        if len(data) != nbytes:
            raise PopefError(f"{what} has {len(data)} bytes; its anchor transfers {nbytes}")
        payload = memoryview(data)

        def tensor_cb(view: memoryview) -> None:
            view[:] = payload
        return tensor_cb
    if len(data) != nbytes * transfers:
        raise PopefError(f"{what} has {len(data)} bytes for {transfers} transfers of {nbytes}")
    chunks = [memoryview(data)[i * nbytes:(i + 1) * nbytes] for i in range(transfers)]
    position = [0]

    def feed_cb(view: memoryview) -> None:
        view[:] = chunks[position[0]]
        position[0] = (position[0] + 1) % transfers
    return feed_cb


def _release(view: memoryview) -> None:
    try:
        view.release()
    except BufferError:  # the callback kept an export (e.g. numpy array) alive
        pass


class StreamTable:
    """The streams of one session (see the module docstring)."""

    def __init__(self, model: popef.Model, pred_tensor_data: PopefDataUsagePredicate | None,
                 look_ahead: int | None,
                 depth_of: Callable[[popef.Anchor], int] | None = None,
                 settings: ShmSettings | None = None) -> None:
        md = model.metadata
        self.flow = md.programFlow()
        self.streams = [a for a in md.anchors()
                        if a.type() in (popef.TensorType.INPUT, popef.TensorType.OUTPUT)]
        self._by_handle = {a.handle(): a for a in self.streams}
        self.nbytes = {a.handle(): a.tensorInfo().sizeInBytes() for a in self.streams}
        self.popef_cbs: dict[str, Callback] = {}
        self.user_cbs: dict[str, Callback] = {}
        # inputs fed a value that never changes (PopEF tensor data, a frozen input):
        # callback -> value; constant while it is the anchor's callback
        load = set(self.flow.load())
        self.load_only = {a.handle() for a in self.streams if a.type() is popef.TensorType.INPUT
                          and a.programs() and set(a.programs()) <= load}
        self._const_values: dict[str, tuple[Callback, memoryview]] = {}
        # PopEF tensor data that Main programs read: a constant only while every IPU that
        # reads it still waits for each request (_main_paced)
        main = set(self.flow.main())
        self._main_in = {a.handle() for a in self.streams if a.type() is popef.TensorType.INPUT
                         and main.intersection(a.programs())}
        self._main_data: set[str] = set()
        self._model = model
        self._reads: list[set[str]] | None = None   # per IPU: what its Main reads
        self.direct: set[str] = set()
        self._errors: list[tuple[str, BaseException]] = []
        self._lock = threading.Lock()
        self._bind_popef_data(model, pred_tensor_data)
        self._rings = StreamRings(self.streams, self.nbytes, {
            a.handle(): ring_depth(a, self.nbytes[a.handle()], main, look_ahead, depth_of)
            for a in self.streams}, settings)
        self.rings = self._rings.rings   # handle -> ring, once made (ensure_rings)

    def _bind_popef_data(self, model: popef.Model, pred: PopefDataUsagePredicate | None) -> None:
        for a in self.streams:
            if a.type() is not popef.TensorType.INPUT:
                continue
            td = model.tensorData(a.name())
            feed = next((f for f in model.feeds if f.anchor == a.name()), None)
            if td is None and feed is None:
                continue
            policy = PopefDataUsagePolicy.USE_POPEF_DATA_IF_ANY if pred is None else pred(a)
            if PopefDataUsagePolicy(policy) is PopefDataUsagePolicy.USE_USER_DATA:
                continue
            n = self.nbytes[a.handle()]
            if td is not None:
                cb = self.popef_cbs[a.handle()] = _popef_input_callback(
                    td.data, n, 1, f"tensor data of {a.name()!r}")
                self._const_values[a.handle()] = (cb, memoryview(td.data))
                if a.handle() in self._main_in:
                    self._main_data.add(a.handle())
            elif feed is not None:
                self.popef_cbs[a.handle()] = _popef_input_callback(
                    feed.data, n, feed.num_transfers, f"feed data of {a.name()!r}")

    # -- lookups ----------------------------------------------------------------------

    def anchor(self, handle: str) -> popef.Anchor:
        """The anchor of a handle (or name); BadRequestError naming the known ones."""
        a = self._by_handle.get(handle)
        if a is not None:
            return a
        for cand in self.streams:
            if cand.name() == handle:
                return cand
        raise BadRequestError(f"unknown anchor {handle!r}; expected one of "
                              + ", ".join(repr(h) for h in self._by_handle))

    def of_type(self, kind: popef.TensorType) -> list[popef.Anchor]:
        return [a for a in self.streams if a.type() is kind]

    def callback(self, handle: str) -> Callback | None:
        cb = self.user_cbs.get(handle)
        return cb if cb is not None else self.popef_cbs.get(handle)

    def connected(self, handle: str) -> bool:
        return handle in self.direct or self.callback(handle) is not None

    def not_connected(self, progs: Sequence[int]) -> dict[int, list[popef.Anchor]]:
        result: dict[int, list[popef.Anchor]] = {}
        for p in progs:
            missing = [a for a in self.streams
                       if p in a.programs() and not self.connected(a.handle())]
            if missing:
                result[int(p)] = missing
        return result

    def check_connected(self, progs: Sequence[int]) -> None:
        """Raise InvalidStateError listing each program's unconnected anchors."""
        missing = self.not_connected(progs)
        if missing:
            parts = "; ".join(f"program {p}: " + ", ".join(repr(a.name()) for a in anchors)
                              for p, anchors in sorted(missing.items()))
            raise InvalidStateError(
                f"anchors not connected to callbacks: {parts}. Bind them with "
                "setCallbackForAnchor / setUserInputHandler / setUserOutputHandler (or a "
                "QueueManager)")

    # -- binding callbacks --------------------------------------------------------------

    def set_callback(self, handle: str, callback: Callback | None) -> None:
        a = self.anchor(handle)
        if a.handle() in self.direct:
            raise InvalidStateError(
                f"anchor {handle!r} is serviced directly (by a QueueManager or ModelRunner); "
                "its callback cannot be set")
        if callback is not None and not callable(callback):
            raise BadRequestError(f"callback for {handle!r} must be callable, got {callback!r}")
        with self._lock:
            if callback is None:
                self.user_cbs.pop(a.handle(), None)
            else:
                self.user_cbs[a.handle()] = callback

    def set_constant(self, handle: str, data: memoryview) -> None:
        """Feed input ``handle`` from ``data``, a value that never changes (its callback;
        a constant while it is, whichever programs read it)."""
        a = self.anchor(handle)
        n = self.nbytes[a.handle()]
        value = memoryview(data).cast("B") if memoryview(data).ndim != 1 else memoryview(data)
        if value.nbytes != n:
            raise BadRequestError(f"the value of input {a.name()!r} has {value.nbytes} bytes; "
                                  f"its anchor transfers {n}")
        cb = _popef_input_callback(value, n, 1, f"the value of {a.name()!r}")
        self.set_callback(a.handle(), cb)
        self._const_values[a.handle()] = (cb, value)

    def constants(self) -> dict[str, tuple[Callback, memoryview]]:
        """The inputs fed now by a value that never changes (handle -> (callback, value)):
        their values go once into shared memory."""
        out = {h: cv for h, cv in self._const_values.items()
               if h not in self.direct and self.callback(h) is cv[0]}
        data = [h for h in out if h in self._main_data]
        if data and not self._main_paced(data, out):
            for h in data:
                del out[h]
        return out

    def _main_paced(self, data: list[str], constant: dict[str, Any]) -> bool:
        """Whether Main's PopEF tensor data ``data`` may be constants (with ``constant``
        the constants then): every IPU that reads one still streams in an input the host
        writes with each request, or a link from an IPU that does; else a main loop would
        run ahead of the requests."""
        def popef_fed(h: str) -> bool:   # by a callback the host serves at once
            return (h not in self.direct and h in self.popef_cbs
                    and self.callback(h) is self.popef_cbs[h])
        streamed = [h for h in self._main_in if h not in constant and not popef_fed(h)]
        if self._model.metadata.numIpus() <= 1:
            return bool(streamed)
        if self._reads is None:
            self._reads = main_reads(self._model.executable.payload(), self.flow.main())
        return paced(self._reads, data, streamed)

    def set_handler(self, anchors: list[popef.Anchor], factory: Callable[[Any], Any],
                    predicate: AnchorCallbackPredicate | None, skip_connected: bool,
                    info: Callable[[popef.Anchor], Any]) -> None:
        if not callable(factory):
            raise BadRequestError(f"factory must be callable, got {factory!r}")
        for a in anchors:
            h = a.handle()
            if h in self.direct or (skip_connected and self.connected(h)):
                continue
            # seed: the factory is called once per tensor; the predicate decides what is bound
            cb = factory(info(a))
            if cb is not None and not callable(cb):
                raise BadRequestError(f"factory returned {cb!r} for anchor {a.name()!r}; "
                                      "expected a callable or None")
            policy = (AnchorCallbackPolicy.BIND_USER_CB if predicate is None
                      else AnchorCallbackPolicy(predicate(a)))
            if policy is AnchorCallbackPolicy.SKIP_CB:
                continue
            if policy is AnchorCallbackPolicy.BIND_EMPTY_CB:
                if h in self.popef_cbs:
                    # an anchor the PopEF file feeds is not the user's to leave empty: the
                    # predicate rejected it (predProgramFlowMain and a Load input), so it
                    # keeps its data, as the reference binds user callbacks to user inputs
                    _log.debug("anchor %r keeps its PopEF data (rejected by the predicate)",
                               a.name())
                    with self._lock:
                        self.user_cbs.pop(h, None)
                    continue
                with self._lock:
                    self.user_cbs[h] = EMPTY
                continue
            if cb is None:
                continue     # the existing callback (user's or PopEF data) stays
            with self._lock:
                self.user_cbs[h] = cb

    def serviced(self, progs: Sequence[int]) -> bool:
        """Whether one of ``progs`` may call back into this process: a stream of theirs
        served by events (MODE_EVENT) that is not a constant input (those the device
        reads in place)."""
        constants, wanted = self.constants(), set(progs)
        return any(m == MODE_EVENT and a.handle() not in constants
                   and not wanted.isdisjoint(a.programs())
                   for a, m in zip(self.streams, self.modes()))

    def modes(self) -> list[int]:
        """The device-side mode of each stream (see ipu_emulator.ipu_protocol)."""
        modes = []
        for a in self.streams:
            h = a.handle()
            if h in self.direct:
                modes.append(MODE_DIRECT)
            elif self.callback(h) is EMPTY:
                modes.append(MODE_NULL)
            else:
                modes.append(MODE_EVENT)
        return modes

    # -- rings ----------------------------------------------------------------------------

    def ring_depth(self, anchor: popef.Anchor) -> int:
        """Slots of ``anchor``'s ring (decided when the session was made)."""
        return self._rings.depth(anchor.handle())

    def ensure_rings(self, peer_pid: int | None,
                     extra: Sequence[tuple[str, int]] = ()) -> None:
        """Create the rings once (``extra``: the session's other regions, counted with
        them); when the device (peer) changes, reset them (:class:`StreamRings`; None:
        no peer yet)."""
        self._rings.ensure(peer_pid, self.constants().keys(), extra)

    def reset_rings(self) -> None:
        self._rings.reset()

    def invalidate_rings(self) -> None:
        """Wake every waiter on the rings (see :meth:`StreamRings.invalidate`)."""
        self._rings.invalidate()

    def load_spec(self, modes: list[int]) -> tuple[LoadStream, ...]:
        """The load spec's streams (``ipu_protocol.LoadSpec``)."""
        return tuple(LoadStream(a.handle(), self.rings[a.handle()].name,
                                "in" if a.type() is popef.TensorType.INPUT else "out",
                                self.nbytes[a.handle()], m)
                     for a, m in zip(self.streams, modes))

    def close(self) -> None:
        self._rings.close()

    # -- servicing (device service thread) ------------------------------------------------------

    def clear_callback_errors(self) -> None:
        self._errors.clear()

    def take_callback_error(self) -> tuple[str, BaseException] | None:
        if not self._errors:
            return None
        first = self._errors[0]
        self._errors.clear()
        return first

    def callback_failure(self, what: str) -> BaseException | None:
        """What a run of ``what`` raises for its callbacks, taken (None: none failed): the
        DeviceExecutionError of the first that raised, or the InvalidStateError of a
        queue that stop() or close() disconnected (as for a stopped run)."""
        failed = self.take_callback_error()
        if failed is None:
            return None
        if getattr(failed[1], "queue_disconnected", False):
            return failed[1]
        return callback_failure(what, *failed)

    def with_callback_error(self, exc: DeviceExecutionError, what: str) -> BaseException:
        """``exc`` (a program failed), or the failure of the callback that made it fail
        (:meth:`callback_failure`)."""
        failed = self.callback_failure(what)
        return exc if failed is None else failed

    def on_need(self, index: int) -> None:
        a = self.streams[index]
        h = a.handle()
        if h in self.direct:
            return   # asked before a claim reached the device: the claimer fills the ring
        ring = self.rings[h]
        cb = self.callback(h)
        try:
            view = ring.acquire_write(timeout=_SERVICE_TIMEOUT)
        except ShmError as exc:
            _log.warning("input %r: cannot write its ring: %s", a.name(), exc)
            return
        n = self.nbytes[h]
        part = view[:n]
        try:
            if cb is None:
                raise InvalidStateError(f"input anchor {a.name()!r} has no callback")
            cb(part)
        except BaseException as exc:
            self._errors.append((h, exc))
            ring.publish(0, tag=TAG_ABORT)
            return
        finally:
            _release(part)
        ring.publish(n)

    def on_out(self, index: int) -> None:
        a = self.streams[index]
        h = a.handle()
        ring = self.rings[h]
        try:
            view, _ = ring.acquire_read(timeout=_SERVICE_TIMEOUT)
        except ShmError as exc:
            _log.warning("output %r: cannot read its ring: %s", a.name(), exc)
            return
        ro = view.toreadonly()
        try:
            cb = self.callback(h)
            if cb is not None:
                cb(ro)
        except BaseException as exc:
            self._errors.append((h, exc))
        finally:
            _release(ro)
            ring.release()


def callback_failure(what: str, handle: str, exc: BaseException) -> DeviceExecutionError:
    """The DeviceExecutionError of ``what`` failing because anchor ``handle``'s callback
    raised ``exc`` (its cause)."""
    err = DeviceExecutionError(f"{what}: the callback of anchor {handle!r} raised "
                               f"{type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err

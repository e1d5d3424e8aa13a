"""The seed's anchor and callback methods of a Session (seed 002, 10.2.4).

Which anchors a model has, which of them PopEF data feeds, and what callback feeds
or drains each: all of it is the session's :class:`StreamTable`, which answers
these methods; :class:`AnchorsAndCallbacks` is the part of ``Session`` that asks it.
"""

from __future__ import annotations

from typing import Sequence

from host_runtime import popef
from host_runtime.session._config import CallbackFactory, CallbackHandle, CallbackInfo
from host_runtime.session._streams import StreamTable
from host_runtime.session.predicates import AnchorCallbackPredicate

__all__ = ["AnchorsAndCallbacks"]


class AnchorsAndCallbacks:
    """The seed's anchor and callback methods, over ``self._streams``."""

    ProgIdxType = int
    """The index of a program of the executable (C++ ``popef::ProgramFlow::ProgramIndexType``)."""
    ProgramsAndAnchorsMap = dict[int, list[popef.Anchor]]
    """Program index -> its anchors (what ``anchorsNotConnectedToCallbacks`` returns)."""

    _streams: StreamTable

    def setCallbackForAnchor(self, anchor_handle: str, callback: CallbackHandle | None) -> None:
        """Set the callback of one anchor (None removes the user's callback)."""
        self._streams.set_callback(anchor_handle, callback)

    def setUserInputHandler(self, factory: CallbackFactory,
                            anchor_callback_predicate: AnchorCallbackPredicate | None = None,
                            skip_connected: bool = False) -> None:
        """Call ``factory`` once per input anchor, those fed from PopEF data included (seed
        002); then the predicate decides: BIND_USER_CB binds what the factory returned (None
        keeps the anchor's callback, PopEF data included), BIND_EMPTY_CB an empty callback
        (but an anchor the PopEF file feeds keeps its data: ``predProgramFlowMain(flow)``
        leaves the Load program's weights to the file), SKIP_CB nothing.
        ``skip_connected``: skip anchors that have a callback (or data). Anchors a
        QueueManager or ModelRunner services directly are skipped."""
        self._streams.set_handler(self.getInputAnchors(), factory, anchor_callback_predicate,
                                  skip_connected, CallbackInfo)

    def setUserOutputHandler(self, factory: CallbackFactory,
                             anchor_callback_predicate: AnchorCallbackPredicate | None = None,
                             skip_connected: bool = False) -> None:
        """Call ``factory`` once per output anchor; the predicate decides what is bound (as
        ``setUserInputHandler``)."""
        self._streams.set_handler(self.getUserOutputAnchors(), factory,
                                  anchor_callback_predicate, skip_connected, CallbackInfo)

    def anchorsNotConnectedToCallbacks(self, progs: Sequence[int]) -> dict[int, list[popef.Anchor]]:
        """For each program: its anchors that have no callback (nor PopEF data, nor a queue)."""
        return self._streams.not_connected(progs)

    def errorIfAnchorsAreNotConnectedToCallbacks(self, progs: Sequence[int]) -> None:
        """Raise InvalidStateError listing each program's unconnected anchors."""
        self._streams.check_connected(progs)

    def getInputAnchors(self) -> list[popef.Anchor]:
        """All input anchors (user-fed and PopEF-data-fed)."""
        return self._streams.of_type(popef.TensorType.INPUT)

    def getOutputAnchors(self) -> list[popef.Anchor]:
        return self._streams.of_type(popef.TensorType.OUTPUT)

    def getUserInputAnchors(self) -> list[popef.Anchor]:
        """Inputs the user must feed: those not bound to PopEF tensor or feed data."""
        return [a for a in self.getInputAnchors() if a.handle() not in self._streams.popef_cbs]

    def getUserOutputAnchors(self) -> list[popef.Anchor]:
        """Outputs the user handles (all outputs: PopEF data never feeds an output)."""
        return self.getOutputAnchors()

    def getPopefInputAnchors(self) -> list[popef.Anchor]:
        """Inputs fed automatically from the model's PopEF tensor or feed data."""
        return [a for a in self.getInputAnchors() if a.handle() in self._streams.popef_cbs]


    def freeze_input(self, anchor_handle: str, data: memoryview) -> None:
        """Internal (ModelRunner): feed input ``anchor_handle`` from ``data``, a value that
        never changes (a frozen input): its value goes once into shared memory for every
        session of this process that has the same value, instead of through this session's
        ring. The caller sees to it that a Main iteration still reads some stream (else the
        device's main loop would not wait for requests)."""
        self._streams.set_constant(anchor_handle, data)

"""PopRT's ``PackRunner``: variable-length requests packed into the rows of one batch.

::

    execute_async(req) --> queue --> packing thread --------------------------> engine
      (a PackFuture)        |   gathers requests for timeout_microseconds      (host_runtime
                            |   from the first one, or until the batch is       .ModelRunner,
                            |   full; places them (_packing), writes the        one execute
                            |   packed inputs, the mask and the unpack info     per batch)
                            |                                                      |
      future.wait() <-------+---- each request's outputs copied back <-------------+

A request is one sequence: its packed inputs are ``[L, ...]`` arrays (``L`` tokens);
an input it leaves out is zeros (the mask: each token gets the request's number);
with padding removal (``enable_padding_remove_mode``) they may be padded, and ``L`` is
the count of non-zero values of the mask. Outputs go back to each request: with the
model's own unpacking (across rows, an ``unpack_info`` input) output row ``k`` of the
batch is request ``k``'s, copied whole; otherwise an output ``[B, S, ...]`` is cut at
the request's tokens and written to the first ``L`` entries of the caller's array.

The thread holds the packer, never the runner: dropping the ``PackRunner`` stops the
thread (requests still queued fail with InvalidStateError) and closes the engine.
"""

from __future__ import annotations

import collections
import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import numpy as np

from host_runtime.errors import BadRequestError, DeviceTimeoutError, InvalidStateError
from host_runtime.memory import as_readable_array
from host_runtime.runner import ModelRunner as _Engine
from host_runtime.runner.config import DataDesc, ModelRunnerConfig

from host_runtime.poprt.runtime._config import PackAlgorithm, PackRunnerConfig, RunnerType
from host_runtime.poprt.runtime._packing import Packer, Place
from host_runtime.poprt.runtime._runner import Runner, register_runner

__all__ = ["PackRunner", "PackFuture"]

UNPACK_INFO = "unpack_info"
MASK = "attention_mask"


def _untraced(error: BaseException) -> BaseException:
    """A copy of ``error`` without its traceback (type, message and cause kept): a stored
    error whose traceback's frames lead back to the future holding it is a reference
    cycle, kept (with what the frames hold) until the garbage collector runs."""
    try:
        new = copy.copy(error)
    except Exception:  # pragma: no cover - an exception type copy cannot rebuild
        return error.with_traceback(None)
    new.__cause__ = error.__cause__
    new.__suppress_context__ = error.__suppress_context__
    return new


class PackFuture:
    """The result of ``PackRunner.execute_async``: ``wait()``, then read the outputs."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def done(self) -> bool:
        return self._done.is_set()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._done.wait(timeout):
            raise DeviceTimeoutError(f"the packed request did not finish within {timeout:g} s")
        return self._error

    def result(self, timeout: float | None = None) -> None:
        err = self.exception(timeout)
        if err is not None:
            raise _untraced(err)   # raising the stored error would trace it: a cycle


@dataclass
class _Request:
    length: int
    inputs: dict[str, np.ndarray]      # packed inputs cut to length (mask included)
    outputs: dict[str, np.ndarray]     # the caller's arrays
    future: PackFuture = field(default_factory=PackFuture)
    t: float = 0.0


class _Layout:
    """The model as packing sees it: packed inputs, mask, unpack info, outputs."""

    def __init__(self, ins: list[DataDesc], outs: list[DataDesc], cfg: PackRunnerConfig) -> None:
        by = {d.name: d for d in ins}
        self.unpack = cfg.unpack_info_input_name or (UNPACK_INFO if UNPACK_INFO in by else "")
        if self.unpack and self.unpack not in by:
            raise BadRequestError(f"PackRunnerConfig.unpack_info_input_name: the model has no "
                                  f"input {self.unpack!r}; inputs: {', '.join(by)}")
        self.mask = cfg.mask_name or (MASK if MASK in by else "")
        candidates = [n for n in by if n != self.unpack]
        dyn = cfg.dynamic_input_name or (cfg.dynamic_group[0] if cfg.dynamic_group else "") \
            or next((n for n in candidates if n != self.mask), "")
        if dyn not in by:
            raise BadRequestError(f"PackRunnerConfig.dynamic_input_name: the model has no "
                                  f"input {dyn!r}; inputs: {', '.join(by)}")
        shape = by[dyn].shape
        if len(shape) < 2:
            raise BadRequestError(f"PackRunner: the dynamic input {dyn!r} must be [batch, "
                                  f"sequence, ...], got shape {shape}")
        self.dynamic = dyn
        self.rows, self.seq = shape[0], shape[1]
        if cfg.compile_batch_size not in (-1, self.rows):
            raise BadRequestError(f"PackRunnerConfig.compile_batch_size: the model's batch is "
                                  f"{self.rows}, got {cfg.compile_batch_size}")
        group = list(cfg.dynamic_group) or candidates
        self.packed = {n: by[n] for n in group if n != self.unpack}
        for n in [*self.packed, *([self.mask] if self.mask else [])]:
            if n not in by or by[n].shape[:2] != [self.rows, self.seq]:
                got = by[n].shape if n in by else "absent"
                raise BadRequestError(f"PackRunner packs inputs of shape [{self.rows}, "
                                      f"{self.seq}, ...] like {dyn!r}; {n!r} is {got}")
        if self.mask and self.mask not in self.packed:
            self.packed[self.mask] = by[self.mask]
        # per-token inputs outside the group (position ids a harness computes for each
        # request) are packed too; the group is what padding removal applies to
        for n in candidates:
            if n not in self.packed and by[n].shape[:2] == [self.rows, self.seq]:
                self.packed[n] = by[n]
        others = set(by) - set(self.packed) - {self.unpack}
        if others:
            raise BadRequestError(f"PackRunner: inputs {sorted(others)} are neither packed "
                                  f"(shaped [{self.rows}, {self.seq}, ...]) nor the unpack info")
        self.unpack_desc = by.get(self.unpack)
        self.single_row = cfg.disable_data_across_rows
        self.per_request = not self.single_row and self.unpack_desc is not None
        self.max_valid = cfg.max_valid_num or (
            self.unpack_desc.shape[0] if self.unpack_desc is not None else 0)
        self.outputs = {d.name: d for d in outs}
        for d in outs:
            if self.per_request and d.shape[0] < self.max_valid:
                raise BadRequestError(f"PackRunner: output {d.name!r} of shape {d.shape} holds "
                                      f"fewer rows than max_valid_num ({self.max_valid})")
            if not self.per_request and d.shape[:2] != [self.rows, self.seq]:
                raise BadRequestError(f"PackRunner: output {d.name!r} must be [{self.rows}, "
                                      f"{self.seq}, ...] to be unpacked, got {d.shape}")


class _Packer:
    """The queue and the packing thread (module docstring)."""

    def __init__(self, engine: _Engine, layout: _Layout, cfg: PackRunnerConfig) -> None:
        self.engine: _Engine | None = engine
        self.lay = layout
        self.timeout_s = cfg.timeout_microseconds / 1e6
        self.places = Packer(layout.rows, layout.seq, layout.single_row,
                             cfg.algorithm is PackAlgorithm.first_fit, layout.max_valid,
                             cfg.delimiter_num if layout.single_row else 0)
        self.queue: collections.deque[_Request] = collections.deque()
        self.cv = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="poprt-pack", daemon=True)
        self.thread.start()

    def submit(self, req: _Request) -> None:
        with self.cv:
            if self.stopping:
                raise InvalidStateError("the PackRunner is closed")
            req.t = time.monotonic()
            self.queue.append(req)
            self.cv.notify()

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify()
        if threading.current_thread() is not self.thread:
            self.thread.join()
        self.engine = None

    def _full(self) -> bool:
        self.places.reset()
        return any(self.places.place(r.length) is None for r in self.queue)

    def _take(self) -> list[tuple[_Request, Place]]:
        self.places.reset()
        batch = []
        while self.queue:
            where = self.places.place(self.queue[0].length)
            if where is None:
                break
            batch.append((self.queue.popleft(), where))
        return batch

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.queue and not self.stopping:
                    self.cv.wait()
                if self.stopping:
                    pending, self.queue = list(self.queue), collections.deque()
                    for r in pending:
                        r.future._finish(InvalidStateError(
                            "the PackRunner was closed before the request ran"))
                    return
                deadline = self.queue[0].t + self.timeout_s
                while not self.stopping and not self._full():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.cv.wait(left)
                if self.stopping:
                    continue
                batch = self._take()
            self._run(batch)
            del batch   # the requests and the callers' arrays go with their answers

    def _run(self, batch: list[tuple[_Request, Place]]) -> None:
        try:
            ins, outs = self._pack(batch)
            engine = self.engine
            if engine is None:
                raise InvalidStateError("the PackRunner is closed")
            engine.execute(ins, outs)
            self._unpack(batch, outs)
        except BaseException as exc:   # every request of the batch hears it
            stored = _untraced(exc)   # its frames hold the batch, whose futures hold it
            for r, _ in batch:
                if not r.future.done():
                    r.future._finish(stored)
            if not isinstance(exc, Exception):
                raise
            return
        for r, _ in batch:
            r.future._finish()

    def _pack(self, batch: list[tuple[_Request, Place]]
              ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        lay = self.lay
        ins = {n: np.zeros(d.shape, d.numpy_data_type()) for n, d in lay.packed.items()}
        for r, at in batch:
            for name, arr in ins.items():
                flat = arr.reshape((lay.rows * lay.seq,) + arr.shape[2:])
                start = at.row * lay.seq + at.col
                value: np.ndarray | int | None = r.inputs.get(name)
                if name == lay.mask:
                    value = at.number if value is None else np.where(value != 0, at.number, 0)
                elif value is None:
                    continue   # an input the request left out: zeros, as PopRT's buffers
                flat[start:start + r.length] = value
        if lay.unpack_desc is not None:
            d = lay.unpack_desc
            info = np.zeros(d.shape, d.numpy_data_type())
            ordered = sorted(batch, key=lambda ra: (ra[1].row, ra[1].col)) \
                if lay.single_row else batch
            for k, (r, _) in enumerate(ordered[:d.shape[0]]):
                info.reshape(d.shape[0], -1)[k, 0] = r.length
            ins[lay.unpack] = info
        outs = {n: np.zeros(d.shape, d.numpy_data_type()) for n, d in lay.outputs.items()}
        return ins, outs

    def _unpack(self, batch: list[tuple[_Request, Place]], outs: dict[str, np.ndarray]) -> None:
        lay = self.lay
        for k, (r, at) in enumerate(batch):
            for name, dest in r.outputs.items():
                out = outs[name]
                if lay.per_request:
                    dest[...] = out[k].reshape(dest.shape)
                    continue
                flat = out.reshape((lay.rows * lay.seq,) + out.shape[2:])
                start = at.row * lay.seq + at.col
                dest[:r.length] = flat[start:start + r.length]


def _as_tokens(a: np.ndarray, tail: Any) -> np.ndarray:
    """``a`` as ``[tokens, *tail]``: every leading dimension before ``tail`` counts as
    tokens, as PopRT reads a request's buffer (``[1, S]`` from a batch-1 data loader
    is ``S`` tokens). A view where numpy can give one; ``a`` unchanged when its
    trailing dimensions are not ``tail`` (the caller's check then names the shape)."""
    tail = tuple(int(d) for d in tail)
    if a.ndim <= len(tail) + 1 or (tail and tuple(a.shape[a.ndim - len(tail):]) != tail):
        return a
    return a.reshape((-1,) + tail)


class PackRunner(Runner):
    """Packs variable-length requests into batches (module docstring)."""

    def __init__(self, popef: Any, config: Optional[ModelRunnerConfig] = None) -> None:
        if not isinstance(config, PackRunnerConfig):
            raise BadRequestError("PackRunner needs a PackRunnerConfig, got "
                                  f"{type(config).__name__}")
        self._packer: _Packer | None = None
        super().__init__(popef, config)
        engine = self.model_runner
        try:
            self._layout = _Layout(engine.getExecuteInputs(), engine.getExecuteOutputs(), config)
            self._padding_remove = config.enable_padding_remove
            self._pack_config = config
            self._packer = _Packer(engine, self._layout, config)
        except BaseException:
            self.close()
            raise

    def _request(self, input: Mapping[str, Any], output: Mapping[str, Any]) -> _Request:
        lay = self._layout
        required = [lay.dynamic] + ([lay.mask] if self._padding_remove else [])
        missing = [n for n in required if n not in input]
        unknown = [n for n in input if n not in lay.packed and n != lay.unpack]
        if missing or unknown:
            raise BadRequestError(f"PackRunner request: expected inputs {sorted(lay.packed)}"
                                  f" (at least {required}); missing {missing}, unexpected "
                                  f"{unknown}")
        arrays = {n: _as_tokens(as_readable_array(input[n], n), lay.packed[n].shape[2:])
                  for n in lay.packed if n in input}
        if self._padding_remove:
            length = int(np.count_nonzero(arrays[lay.mask]))
        else:
            length = int(arrays[lay.dynamic].shape[0]) if arrays[lay.dynamic].ndim else 0
        packer = self._live().places
        if not packer.fits_alone(length):
            raise BadRequestError(
                f"PackRunner request: {lay.dynamic!r} has {length} tokens; expected 1.."
                f"{lay.seq if lay.single_row else lay.rows * lay.seq}")
        cut = {}
        for n, a in arrays.items():
            want = tuple(lay.packed[n].shape[2:])
            if a.shape[0] < length or tuple(a.shape[1:]) != want:
                raise BadRequestError(f"PackRunner request: input {n!r} must be [{length}"
                                      f"{''.join(', ' + str(d) for d in want)}], got "
                                      f"{list(a.shape)}")
            cut[n] = a[:length]
        outs = {}
        for n, dest in output.items():
            if n not in lay.outputs:
                raise BadRequestError(f"PackRunner request: the model has no output {n!r}; "
                                      f"outputs: {', '.join(lay.outputs)}")
            if not isinstance(dest, np.ndarray) or not dest.flags.writeable:
                raise BadRequestError(f"PackRunner request: output {n!r} must be a writable "
                                      f"numpy array, got {type(dest).__name__}")
            row = lay.outputs[n].shape[1:] if lay.per_request else lay.outputs[n].shape[2:]
            if lay.per_request and dest.size != int(np.prod(row)):
                raise BadRequestError(f"PackRunner request: output {n!r} holds one row of the "
                                      f"unpacked output, {row}; got shape {list(dest.shape)}")
            if not lay.per_request:
                flat = _as_tokens(dest, row)
                if flat.ndim < 1 or flat.shape[0] < length or list(flat.shape[1:]) != row or \
                        not np.shares_memory(flat, dest):
                    raise BadRequestError(
                        f"PackRunner request: output {n!r} must be [>= {length}"
                        f"{''.join(', ' + str(d) for d in row)}] (the request's tokens), "
                        f"got {list(dest.shape)}")
                dest = flat
            outs[n] = dest
        return _Request(length, cut, outs)

    def _live(self) -> _Packer:
        p = self._packer
        if p is None:
            raise InvalidStateError("the PackRunner is closed")
        return p

    def execute_async(self, input: Mapping[str, Any],  # type: ignore[override]
                      output: Optional[Mapping[str, Any]] = None) -> PackFuture:
        """Queue one request; it runs packed with others; ``wait()`` then read outputs."""
        req = self._request(input, output or {})
        self._live().submit(req)
        return req.future

    executeAsync = execute_async  # type: ignore[assignment]

    def execute(self, input: Mapping[str, Any], output: Mapping[str, Any]) -> None:
        self.execute_async(input, output).result()

    def reload(self) -> None:
        """Load the model again (Runner's), with a new packing thread over it."""
        super().reload()   # closes: the old thread stops, its queued requests fail
        self._packer = _Packer(self.model_runner, self._layout, self._pack_config)

    def close(self) -> None:
        p, self._packer = self.__dict__.get("_packer"), None
        if p is not None:
            p.stop()
        super().close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


register_runner(RunnerType.PackRunner, PackRunner)

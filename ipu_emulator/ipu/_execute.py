"""The compiled ``Execute`` steps: an onnxruntime run whose IO binding points straight
at device memory (``execute_step``), or, for an Execute with zero-copy streams, at the
transfer buffers the ``StreamIO`` lends (``execute_zc_step``, one bound IO binding kept
per combination of buffer addresses). Outputs that are an input (forwarded by an
Identity, or the same name) are copied after the run instead of bound: onnxruntime does
not write those into a bound buffer.

These steps are the hot path of a program run: everything is looked up and bound when
they are made; a run calls onnxruntime and, for zero-copy, looks one binding up.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any, Callable

import numpy as np

from shm import buffer_address as _address
from shm.copy import copy_bytes

from ipu_emulator.errors import DeviceProgramError
from ipu_emulator.executable import Execute, Graph
from ipu_emulator.ipu._stream_api import Step, StreamIO, ZeroCopyGroup
from ipu_emulator.trace import recorder

__all__ = ["checked", "execute_step", "execute_zc_step", "source_of"]

_Entry = tuple[Any, Callable[..., Any], tuple[Any, ...]]
"""A bound IO binding and how to run it: ``(binding, fn, args)``, run as ``fn(*args)``."""


def source_of(i: Execute, output: str, graph: Graph, forwarded: dict[str, str]) -> str | None:
    """The device tensor bound to the input that ONNX output ``output`` of ``i``'s graph
    is a copy of (the same name, or forwarded by an Identity: ``forwarded``), else None."""
    name = output if any(s.name == output for s in graph.inputs) else forwarded.get(output)
    return None if name is None else dict(i.inputs).get(name)


def execute_step(i: Execute, sess: Any, graph: Graph, arrays: dict[str, np.ndarray],
                 forwarded: dict[str, str], exe_name: str) -> Step:
    """The step of ``i`` bound to the device tensors ``arrays``."""
    binding = sess.io_binding()
    for onnx_name, tname in i.inputs:
        arr = arrays[tname]
        binding.bind_input(onnx_name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
    # outputs that are an input (forwarded, or the same name: onnxruntime does not write
    # those into a bound buffer) are copied after the run instead of bound
    copies: list[tuple[np.ndarray, np.ndarray]] = []   # (destination, source) bytes
    bound = 0
    for onnx_name, tname in i.outputs:
        arr = arrays[tname]
        src = source_of(i, onnx_name, graph, forwarded)
        if src is not None:
            copies.append((_bytes_of(arr), _bytes_of(arrays[src])))
            continue
        binding.bind_output(onnx_name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        bound += 1
    run, run_args = _runner(sess, binding)
    gid = i.graph

    def execute(io: StreamIO) -> None:
        t0 = time.monotonic_ns() if recorder.ON else 0
        if bound:
            try:
                run(*run_args)
            except Exception as exc:
                raise DeviceProgramError(f"executable {exe_name!r}: graph {gid} failed in "
                                         f"onnxruntime: {exc}") from exc
        for dst, src in copies:
            copy_bytes(dst, src)
        if t0:
            recorder.ipu(recorder.I_COMPUTE, t0, time.monotonic_ns() - t0, gid)
    return execute


class _ZcLayout:
    """Where each ONNX input and output of a zero-copy Execute lies: a device tensor
    (``fixed_in``/``fixed_out``: (onnx name, array)) or a lent transfer (``zc_in``/
    ``zc_out``: (onnx name, handle, array); a binding's key is their buffers' addresses,
    inputs first). ``copies``: outputs that are a copy of an input, ``(output's place,
    input's place, nbytes)``, each place a transfer's index in the key or, if negative, a
    device tensor's bytes (``fixed[~place]``)."""

    def __init__(self, i: Execute, graph: Graph, arrays: dict[str, np.ndarray],
                 forwarded: dict[str, str], zc_in: dict[str, str],
                 zc_out: dict[str, str]) -> None:
        self.fixed_in: list[tuple[str, np.ndarray]] = []
        self.zc_in: list[tuple[str, str, np.ndarray]] = []
        index: dict[str, int] = {}                  # device tensor -> index in zc_in
        for onnx_name, tname in i.inputs:
            arr = arrays[tname]
            h = zc_in.get(tname)
            if h is None:
                self.fixed_in.append((onnx_name, arr))
            else:
                index[tname] = len(self.zc_in)
                self.zc_in.append((onnx_name, h, arr))
        self.fixed_out: list[tuple[str, np.ndarray]] = []
        self.zc_out: list[tuple[str, str, np.ndarray]] = []
        self.copies: list[tuple[int, int, int]] = []
        self.fixed: list[np.ndarray] = []
        for onnx_name, tname in i.outputs:
            arr = arrays[tname]
            src = source_of(i, onnx_name, graph, forwarded)
            if src is not None:
                from_ = index[src] if src in index else self._fixed(arrays[src])
                if tname in zc_out:
                    to = len(self.zc_in) + len(self.zc_out)
                    self.zc_out.append((onnx_name, zc_out[tname], arr))
                else:
                    to = self._fixed(arr)
                self.copies.append((to, from_, arr.nbytes))
                continue
            h = zc_out.get(tname)
            if h is None:
                self.fixed_out.append((onnx_name, arr))
            else:
                self.zc_out.append((onnx_name, h, arr))
        self.copied = {to for to, _, _ in self.copies}
        n_in = len(self.zc_in)
        self.computed = bool(self.fixed_out) or any(
            n_in + k not in self.copied for k in range(len(self.zc_out)))

    def _fixed(self, arr: np.ndarray) -> int:
        self.fixed.append(_bytes_of(arr))
        return ~(len(self.fixed) - 1)

    def place(self, key: tuple[int, ...], where: int, nbytes: int) -> np.ndarray:
        return self.fixed[~where] if where < 0 else _bytes_at(key[where], nbytes)

    def group(self) -> ZeroCopyGroup:
        return ZeroCopyGroup(tuple(h for _, h, _ in self.zc_in),
                             tuple(arr.nbytes for _, _, arr in self.zc_in),
                             tuple(h for _, h, _ in self.zc_out),
                             tuple(arr.nbytes for _, _, arr in self.zc_out))


def _binder(sess: Any, lay: _ZcLayout,
            cache: dict[tuple[int, ...], _Entry]) -> Callable[[tuple[int, ...]], _Entry]:
    """``bind(key)``: a new IO binding of ``sess`` for the transfer addresses ``key``,
    put in ``cache`` (emptied first when it holds ``_BINDING_CACHE``)."""
    n_in = len(lay.zc_in)

    def bind(key: tuple[int, ...]) -> _Entry:
        if len(cache) >= _BINDING_CACHE:
            cache.clear()
        b = sess.io_binding()
        for name, arr in lay.fixed_in:
            b.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        for (name, _, arr), ptr in zip(lay.zc_in, key):
            b.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), ptr)
        for name, arr in lay.fixed_out:
            b.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        for k, ((name, _, arr), ptr) in enumerate(zip(lay.zc_out, key[n_in:])):
            if n_in + k not in lay.copied:
                b.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), ptr)
        run, args = _runner(sess, b)
        entry: _Entry
        if lay.copies:   # copied here, after onnxruntime computes the other outputs (if any)
            pairs = [(lay.place(key, to, n), lay.place(key, from_, n))
                     for to, from_, n in lay.copies]
            entry = (b, _run_and_copy, (run if lay.computed else None, args, pairs))
        else:
            entry = (b, run, args)
        cache[key] = entry
        return entry
    return bind


def execute_zc_step(i: Execute, sess: Any, graph: Graph, arrays: dict[str, np.ndarray],
                    forwarded: dict[str, str], zc_in: dict[str, str], zc_out: dict[str, str],
                    views: dict[str, memoryview], deferred: list[str],
                    exe_name: str) -> tuple[Step, ZeroCopyGroup]:
    """The step of an Execute whose zero-copy inputs/outputs (``zc_in``/``zc_out``:
    device tensor -> handle) are bound to the transfers' buffers, and its group.

    Ring slots are a fixed set of buffers, so the combinations of buffer addresses
    repeat: one fully bound IO binding per combination is kept (binding costs ~0.7 us
    per tensor, a dict lookup ~0.1 us). ``views``: the inputs' acquired transfers (the
    StreamIn steps put them there); ``deferred``: inputs to release after the next
    publish (the StreamOut steps release them).
    """
    lay = _ZcLayout(i, graph, arrays, forwarded, zc_in, zc_out)
    group = lay.group()
    cache = group.calls
    bind = _binder(sess, lay, cache)
    in_handles = list(group.in_handles)
    out_specs = list(zip(group.out_handles, group.out_sizes))
    gid = i.graph
    # With zero-copy outputs, the inputs are released after the first of them is
    # published (the host waits for that publish, not for the releases).
    defer = bool(in_handles and out_specs)

    def execute_zc(io: Any) -> None:
        ran = False
        try:
            ptrs = list(map(_address, map(views.__getitem__, in_handles)))
            for h, n in out_specs:
                v = io.acquire_output(h, n)
                if v.nbytes != n or not v.c_contiguous:
                    checked(v, n, h)
                ptrs.append(_address(v))
            key = tuple(ptrs)
            entry = cache.get(key)
            if entry is None:
                entry = bind(key)
            t0 = time.monotonic_ns() if recorder.ON else 0
            try:
                entry[1](*entry[2])
            except Exception as exc:
                raise DeviceProgramError(f"executable {exe_name!r}: graph {gid} failed in "
                                         f"onnxruntime: {exc}") from exc
            if t0:
                recorder.ipu(recorder.I_COMPUTE, t0, time.monotonic_ns() - t0, gid)
            ran = True
        finally:
            if ran and defer:
                deferred.extend(in_handles)
            else:
                for h in in_handles:
                    if views.pop(h, None) is not None:
                        io.release_input(h)
    return execute_zc, group


_BINDING_CACHE = 256
"""Most fully bound IO bindings kept per zero-copy Execute."""


_RUN_OPTIONS: list[Any] = []
"""One default ``onnxruntime.RunOptions``, made once and given to every run."""


def _run_options() -> Any:
    if not _RUN_OPTIONS:
        import onnxruntime

        _RUN_OPTIONS.append(onnxruntime.RunOptions())
    return _RUN_OPTIONS[0]


def _runner(sess: Any, binding: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``(fn, args)`` such that ``fn(*args)`` is ``sess.run_with_iobinding(binding)``.

    Uses onnxruntime's C-level objects when they are there (the Python wrapper
    adds ~0.5 us of checks per run), else the public method; with run options made
    once (without, onnxruntime makes default ones for each run: 0.7 of a [1,4] run's
    2.3 us here).
    """
    raw_sess = getattr(sess, "_sess", None)
    raw_binding = getattr(binding, "_iobinding", None)
    run = getattr(raw_sess, "run_with_iobinding", None)
    if run is not None and raw_binding is not None:
        return run, (raw_binding, _run_options())
    return sess.run_with_iobinding, (binding, _run_options())


def _run_and_copy(run: Callable[..., Any] | None, args: tuple[Any, ...],
                  pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """An Execute with outputs copied from inputs: onnxruntime computes the others
    (``run`` is None when there are none), then each ``(destination, source)`` copy."""
    if run is not None:
        run(*args)
    for dst, src in pairs:
        copy_bytes(dst, src)


def _bytes_of(arr: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous device tensor, flat."""
    return arr.reshape(-1).view(np.uint8)


def _bytes_at(address: int, nbytes: int) -> np.ndarray:
    """``nbytes`` bytes of a transfer buffer at ``address`` (valid as long as its slot is
    mapped: the same lifetime as onnxruntime's binding to it)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def checked(view: memoryview, nbytes: int, handle: str) -> memoryview:
    """A lent transfer buffer must be exactly one contiguous transfer."""
    if view.nbytes != nbytes or not view.c_contiguous:
        raise DeviceProgramError(
            f"stream {handle!r}: the stream lent a buffer of {view.nbytes} bytes"
            f"{'' if view.c_contiguous else ' (not contiguous)'}; one transfer is "
            f"{nbytes} bytes")
    return view


"""A request as the user gives it, checked and made into a :class:`Request`.

:class:`RequestIntake` checks every request before anything is sent (names,
shapes, dtypes, sizes, batch sizes -> ``BadRequestError`` that names the
tensor, what was expected and what was given), allocates or borrows output
memory, and says which transfers the request takes (``ModelLayout.plan``).

The common request (:meth:`RequestIntake.build_plain`: a plain dict of every
execute input, each an ndarray of the model's dtype and whole shape, outputs
allocated by the runner) is recognised and made with fewer checks; the setting
``IPU_EMULATOR_RUNNER_PLAIN=0`` sends it through :meth:`RequestIntake.build`
like any other.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

import numpy as np

from shm import arrays as shm_arrays

from host_runtime.errors import BadRequestError
from host_runtime.memory import (InputMemoryView, TensorMemory, TensorMemoryView,
                                 as_readable_array, as_writable_array)
from host_runtime.runner._batching import TensorSpec
from host_runtime.runner._layout import ModelLayout
from host_runtime.runner._requests import Driver, Request

__all__ = ["Built", "RequestIntake"]


class Built(NamedTuple):
    """A checked request: what ``RequestIntake.build`` returns."""

    request: Request
    transfers: int              # whole transfers (dynamic batching: 1, packed by the replica)
    phantom: Optional[str]      # the input the device would wait for, never given
    view_mode: bool             # the inputs were an InputMemoryView (results: OutputMemory)


def _plain_plan(specs: Mapping[str, TensorSpec]
                ) -> tuple[tuple[str, type, bytes, tuple[int, ...]], ...] | None:
    """``shm.arrays.plain_arrays``'s plan for the common request's inputs ``specs``: for
    each, an ndarray (exactly) of its dtype's buffer format (the same layout of bytes)
    and its shape; None if a dtype exports no buffer (no PopEF type: such a request takes
    the general path)."""
    try:
        return tuple((name, np.ndarray, np.empty(1, s.dtype).data.format.encode(),
                      tuple(int(d) for d in s.shape)) for name, s in specs.items())
    except (TypeError, ValueError, BufferError):
        return None


class RequestIntake:
    """Checks and makes the requests of one runner (see the module docstring)."""

    def __init__(self, layout: ModelLayout, validate_io_params: bool, plain: bool) -> None:
        self.layout = layout
        self._validate = validate_io_params
        self._plain_ok = plain and layout.plain_ok
        # what the common request's inputs are, checked in one call (shm.arrays)
        self._plain_plan = _plain_plan(layout.exec_specs)

    def build(self, driver: Driver, rid: int, inputs: Any, outputs: Any, t0: int,
              internal: bool = False) -> Built:
        """Check a request and make it."""
        if type(inputs) is not dict and not isinstance(inputs, Mapping):
            raise BadRequestError(f"inputs must be an InputMemoryView or a dict of name -> array, "
                                  f"got {type(inputs).__name__}")
        lay = self.layout
        view_mode = isinstance(inputs, InputMemoryView)
        validate = self._validate and not internal
        dynamic = lay.dynamic
        specs = lay.exec_specs
        given: dict[str, np.ndarray] = {}
        counts: dict[str, int] = {}
        for name, value in inputs.items():
            spec = specs.get(name)
            if spec is None:
                if name in lay.frozen:
                    continue   # seed: a frozen input is no longer required; the frozen value wins
                raise BadRequestError(
                    f"unknown input tensor {name!r}; the model's execute inputs are "
                    + ", ".join(repr(n) for n in specs))
            arr = value if type(value) is np.ndarray else as_readable_array(value, name)
            if arr.dtype == spec.dtype and arr.shape == spec.shape:
                given[name] = arr
                counts[name] = 1 if not dynamic else spec.batch
                continue
            samples = spec.samples_of(arr)
            given[name] = spec.typed(arr, samples)
            if spec.batch_dim is None:
                counts[name] = 1 if not dynamic else -1
            else:
                counts[name] = samples if dynamic else samples // spec.batch
        if validate and len(given) != len(specs):
            missing = [n for n in specs if n not in given]
            raise BadRequestError(
                "missing input tensor(s) " + ", ".join(repr(n) for n in missing)
                + "; the model's execute inputs are " + ", ".join(repr(n) for n in specs)
                + " (set validate_io_params = False to give only some of them)")
        units = {v for v in counts.values() if v != -1}
        if len(units) > 1:
            what = "samples" if dynamic else "transfers of the model's batch"
            detail = ", ".join(f"{k} has {v}" for k, v in counts.items() if v != -1)
            raise BadRequestError(f"the request's tensors disagree on the batch size ({what}): "
                                  f"{detail}")
        n_units = units.pop() if units else 1
        transfers = 1 if dynamic else n_units     # dynamic: packed by the replica

        # what the device reads and writes, transfer by transfer
        publish, per_transfer, phantom = lay.plan(given, transfers)
        dests, results = self._outputs(outputs, per_transfer, n_units, validate)
        req = Request(driver, rid, n_units, publish, dests, results, per_transfer, t0,
                      internal=internal, given=given)
        return Built(req, transfers, phantom, view_mode)

    def _outputs(self, outputs: Any, per_transfer: list[tuple[TensorSpec, ...]], n_units: int,
                 validate: bool) -> tuple[dict[str, Optional[np.ndarray]], dict[str, Any]]:
        """(output name -> typed destination, output name -> what the user gets back)."""
        lay = self.layout
        dests: dict[str, Optional[np.ndarray]] = {}
        results: dict[str, Any] = {}
        if outputs is None:
            produced: dict[str, TensorSpec] = {}
            for outs in per_transfer:
                for s in outs:
                    produced[s.name] = s
            for name, s in produced.items():
                mem = TensorMemory.allocate(s.shape_for(lay.out_samples(s, n_units)), s.dtype)
                dests[name] = mem
                results[name] = mem
            return dests, results
        if type(outputs) is not dict and not isinstance(outputs, Mapping):
            raise BadRequestError(f"outputs must be an OutputMemoryView or a dict of name -> "
                                  f"array, got {type(outputs).__name__}")
        for name, value in outputs.items():
            found = lay.out_specs.get(name)
            if found is None:
                raise BadRequestError(
                    f"unknown output tensor {name!r}; the model's execute outputs are "
                    + ", ".join(repr(n) for n in lay.out_specs))
            s = found
            arr = as_writable_array(value, name)
            shape = s.shape_for(lay.out_samples(s, n_units))
            if arr.dtype == s.dtype and tuple(arr.shape) == shape:
                typed = arr
            else:
                typed = self._check_output(s, arr, shape)
            dests[name] = typed
            results[name] = typed.view(TensorMemoryView)
        if validate:
            missing = [n for n in lay.out_specs if n not in dests]
            if missing:
                raise BadRequestError(
                    "missing output tensor(s) " + ", ".join(repr(n) for n in missing)
                    + "; give memory for every output: " + ", ".join(
                        repr(n) for n in lay.out_specs))
        return dests, results

    @staticmethod
    def _check_output(s: TensorSpec, arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        raw = arr.dtype == np.uint8 and s.dtype != np.uint8
        need = int(np.prod(shape, dtype=np.int64)) * s.dtype.itemsize
        if arr.ndim == 1 and len(shape) != 1 and isinstance(arr, TensorMemoryView) \
                and arr.flags.c_contiguous:
            raw, arr = True, arr.view(np.uint8)   # a flat view: its bytes decide (reference)
        if raw:
            if arr.nbytes < need:
                raise BadRequestError(
                    f"output {s.name!r}: the buffer is too small; expected {need} bytes "
                    f"(shape {list(shape)}, dtype {s.dtype}), got {arr.nbytes} bytes")
            return arr.reshape(-1)[:need].view(s.dtype).reshape(shape)
        if arr.dtype != s.dtype:
            raise BadRequestError(f"output {s.name!r}: expected dtype {s.dtype}, got {arr.dtype}")
        raise BadRequestError(f"output {s.name!r}: expected shape {list(shape)} for this request, "
                              f"got shape {list(arr.shape)}")

    # -- the common request -------------------------------------------------------------
    def is_plain(self, inputs: Any, outputs: Any) -> bool:
        """Whether ``inputs`` and ``outputs`` make the common request (see the module
        docstring); always False with ``IPU_EMULATOR_RUNNER_PLAIN=0``."""
        if not self._plain_ok or outputs is not None or self._plain_plan is None:
            return False
        return shm_arrays.plain_arrays(inputs, self._plain_plan)

    def build_plain(self, driver: Driver, rid: int, inputs: Any, outputs: Any, t0: int,
                    plain_results: bool) -> Optional[Request]:
        """``build`` for the common request, or None when ``inputs`` is not one.

        ``plain_results``: outputs as plain ndarrays (``execute``), else as TensorMemory
        (futures). ``outputs``: None, or the user's memory for every output, each a
        writable ndarray of the output's dtype and whole shape (``plain_dests``). Anything
        else takes ``build``, which checks and reports it."""
        if outputs is not None:
            if not self._plain_ok or inputs.__class__ is not dict:
                return None
            dests = self.plain_dests(outputs)
            if dests is None or not self.is_plain(inputs, None):
                return None
            given = dict(inputs)
            return Request(driver, rid, 1, given, dests,   # type: ignore[arg-type]
                           {name: arr.view(TensorMemoryView) for name, arr in dests.items()},
                           self.layout.plain_transfers, t0, False, given)
        if not self.is_plain(inputs, outputs):
            return None
        given = dict(inputs)
        results: dict[str, Any] = {}
        if plain_results:
            empty = np.empty
            for name, shape, dtype in self.layout.plain_outputs:
                results[name] = empty(shape, dtype)
        else:
            for name, shape, dtype in self.layout.plain_outputs:
                results[name] = TensorMemory.allocate(shape, dtype)
        return Request(driver, rid, 1, given, dict(results), results,
                       self.layout.plain_transfers, t0, False, given)

    def plain_dests(self, outputs: Any) -> Optional[dict[str, np.ndarray]]:
        """``outputs`` as the destinations of a common request (a dict of every output,
        each a writable ndarray of its dtype and whole shape), else None."""
        plain = self.layout.plain_outputs
        if outputs.__class__ is not dict or len(outputs) != len(plain):
            return None
        for name, shape, dtype in plain:
            arr = outputs.get(name)
            if (arr is None or arr.__class__ is not np.ndarray or arr.dtype is not dtype
                    or arr.shape != shape or not arr.flags.writeable):
                return None
        return dict(outputs)

    # -- what the timers ask (flush_callback's data) --------------------------------------
    def merge_phantom(self, req: Request, extra: Request) -> Optional[int]:
        """``req`` (its inputs incomplete) completed by ``extra``: its transfers, or None
        if an input is still missing."""
        given = dict(req.given)
        given.update(extra.given)
        transfers = len(req.outputs_per_transfer)
        publish, per_transfer, missing = self.layout.plan(given, transfers)
        if missing is not None:
            return None
        req.given = given
        req.inputs = publish
        req.outputs_per_transfer = per_transfer
        for name, dest in extra.dests.items():
            if dest is not None:
                req.dests[name] = dest
        return transfers

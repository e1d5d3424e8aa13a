"""What a ``ModelRunner`` reads of its model, once: the anchors a request carries, how
a batch is laid out, fused sub-graphs, frozen inputs and the save programs' outputs.

:class:`ModelLayout` is built when the runner is made and never changes. It
checks the configuration against the model (frozen inputs, batching dimension,
save outputs) with ``BadRequestError`` naming what was expected and what was
given, and says which inputs and outputs one request's transfers move
(:meth:`ModelLayout.plan`).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import numpy as np

from host_runtime import popef
from host_runtime.errors import BadRequestError
from host_runtime.memory import as_readable_array, as_writable_array
from host_runtime.runner._batching import TensorSpec
from host_runtime.runner._read_order import main_read_order
from host_runtime.runner.config import ModelRunnerConfig

__all__ = ["ModelLayout", "INDEX_NAME"]

INDEX_NAME = "index"
"""A fused model's input that selects the sub-graph a request runs."""


class ModelLayout:
    """The model as the runner sees it (see the module docstring)."""

    def __init__(self, model: popef.Model, cfg: ModelRunnerConfig) -> None:
        self.batching_enabled = cfg.batching_enabled
        md = model.metadata
        flow = md.programFlow()
        main, load, save = set(flow.main()), set(flow.load()), set(flow.save())
        self.with_data = {t.anchor for t in model.tensors} | {f.anchor for f in model.feeds}
        anchors = md.anchors()
        self.inputs_all = [a for a in anchors if a.type() == popef.TensorType.INPUT]
        self.outputs_all = [a for a in anchors if a.type() == popef.TensorType.OUTPUT]
        by_name = {a.name(): a for a in anchors}

        def in_main(a: popef.Anchor) -> bool:
            return bool(main.intersection(a.programs()))

        self._read_frozen(cfg, by_name, load, in_main)

        # the anchors a request may carry, and the layout of batches
        batch_dim: Optional[int] = cfg.batching_dim if cfg.batching_enabled else 0
        self.dynamic = cfg.batching_enabled
        # a frozen input is the runner's to feed even when the PopEF file has data for it
        self.main_inputs = [a for a in self.inputs_all if in_main(a) and (
            a.name() not in self.with_data or a.name() in self.frozen)]
        self.exec_inputs = [a for a in self.main_inputs if a.name() not in self.frozen]
        self.main_outputs = [a for a in self.outputs_all if in_main(a)]
        self.fused = bool(md.subgraphs()) and by_name.get(INDEX_NAME) is not None
        self.in_specs = {a.name(): self._spec(a, batch_dim) for a in self.main_inputs}
        # the order Main reads its inputs: the device waits for the first one missing
        self.read_rank = {n: k for k, n in enumerate(main_read_order(model))}
        self.out_specs = {a.name(): self._spec(a, batch_dim) for a in self.main_outputs}
        self.exec_specs = {a.name(): self.in_specs[a.name()] for a in self.exec_inputs}
        self.all_outputs = tuple(self.out_specs.values())
        # The common request (RequestIntake.build_plain): whole-batch tensors of the model's
        # dtype and shape for every execute input, outputs allocated by the runner.
        self.plain_ok = not self.dynamic and not self.fused
        self.plain_outputs = [(s.name, s.shape_for(s.batch), s.dtype) for s in self.all_outputs]
        self.plain_transfers = [self.all_outputs]
        self.batch = self._check_dynamic(cfg.batching_dim) if self.dynamic else 1
        self._read_subgraphs(md.subgraphs())
        # save programs: where their outputs go
        self.save_outputs = [a for a in self.outputs_all if save.intersection(a.programs())]
        self.has_save_programs = bool(flow.save())
        self._check_save_outputs(cfg)

    def _read_frozen(self, cfg: ModelRunnerConfig, by_name: dict[str, popef.Anchor],
                     load: set[int], in_main: Callable[[popef.Anchor], bool]) -> None:
        """Frozen inputs, typed to the model's exact shape; every input of the load
        program must have data in the file or a frozen value."""
        self.frozen: dict[str, np.ndarray] = {}
        for name, value in cfg.frozen_inputs.items():
            a = by_name.get(name)
            if a is None or a.type() != popef.TensorType.INPUT:
                raise BadRequestError(
                    f"ModelRunnerConfig.frozen_inputs: the model has no input {name!r}; expected "
                    "one of " + ", ".join(repr(x.name()) for x in self.inputs_all))
            self.frozen[name] = self.typed_value(a, value)
        self.frozen_load = {n: v for n, v in self.frozen.items() if not in_main(by_name[n])}
        self.load_only = {a.name(): a for a in self.inputs_all
                          if load.intersection(a.programs()) and not in_main(a)}
        for a in self.inputs_all:
            if a.name() in self.frozen or a.name() in self.with_data:
                continue
            if load.intersection(a.programs()) and not in_main(a):
                raise BadRequestError(
                    f"input {a.name()!r} of the load program has no tensor data in the PopEF "
                    "file; give its value in ModelRunnerConfig.frozen_inputs")

    def _read_subgraphs(self, subs: dict[str, list[str]]) -> None:
        """Fused models: what each sub-graph reads and writes."""
        self.sub_inputs: list[list[str]] = []
        self.sub_outputs: list[tuple[TensorSpec, ...]] = []
        if not self.fused:
            return
        k = 0
        while f"graph{k}" in subs:
            members = set(subs[f"graph{k}"])
            self.sub_inputs.append([n for n in self.in_specs if n in members])
            self.sub_outputs.append(tuple(s for n, s in self.out_specs.items()
                                          if n in members))
            k += 1

    def _check_save_outputs(self, cfg: ModelRunnerConfig) -> None:
        """Where the save programs' outputs go: known outputs, memory large enough."""
        for rid, view in cfg.replica_to_save_programs_outputs.items():
            known = {a.name(): a for a in self.save_outputs}
            for name, mem in dict(view).items():
                a = known.get(name)
                if a is None:
                    raise BadRequestError(
                        f"ModelRunnerConfig.replica_to_save_programs_outputs[{rid}]: {name!r} is "
                        "not an output of the save programs; expected one of "
                        + (", ".join(repr(n) for n in known) or "(none)"))
                arr = as_writable_array(mem, name)
                if arr.nbytes < a.tensorInfo().sizeInBytes():
                    raise BadRequestError(
                        f"save output {name!r} of replica {rid}: expected at least "
                        f"{a.tensorInfo().sizeInBytes()} bytes, got {arr.nbytes}")

    def _spec(self, a: popef.Anchor, batch_dim: Optional[int]) -> TensorSpec:
        info = a.tensorInfo()
        bd = batch_dim
        if (a.name() == INDEX_NAME and self.batching_enabled) or not info.shape():
            bd = None     # scalars, and a fused model's index under dynamic batching
        return TensorSpec(a.name(), a.handle(), tuple(info.shape()), info.numpyDType(),
                          a.type() == popef.TensorType.INPUT, bd,
                          self.batching_enabled and bd is not None)

    def _check_dynamic(self, dim: int) -> int:
        specs = [s for s in (*self.in_specs.values(), *self.out_specs.values())
                 if s.name != INDEX_NAME]
        batches = set()
        for s in specs:
            if s.batch_dim is None:
                raise BadRequestError(
                    f"batching_dim={dim}: tensor {s.name!r} has shape {list(s.shape)}, which has "
                    f"no dimension {dim}; expected every input and output to have it")
            batches.add(s.batch)
        if len(batches) > 1:
            detail = ", ".join(f"{s.name} {list(s.shape)}" for s in specs)
            raise BadRequestError(f"batching_dim={dim}: the tensors disagree on the batch size "
                                  f"along dimension {dim}: {detail}")
        return batches.pop() if batches else 1

    def by_read_order(self, names: Iterable[str]) -> list[str]:
        """``names`` in the order the Main programs read them (unread ones last)."""
        rank = self.read_rank
        return sorted(names, key=lambda n: rank.get(n, len(rank)))

    def direct_inputs(self) -> dict[str, TensorSpec]:
        """The Main inputs a replica writes (frozen ones included), in the order Main reads them."""
        return {n: self.in_specs[n] for n in self.by_read_order(self.in_specs)}

    def typed_value(self, a: popef.Anchor, value: object) -> np.ndarray:
        """``value`` as input ``a`` takes it whole: the model's dtype and exact shape."""
        spec = self._spec(a, None)
        arr = as_readable_array(value, a.name())
        spec.samples_of(arr)   # exact shape / size check
        return np.ascontiguousarray(spec.typed(arr, spec.batch))

    def plan(self, given: dict[str, np.ndarray], transfers: int
             ) -> tuple[dict[str, np.ndarray], list[tuple[TensorSpec, ...]], Optional[str]]:
        """(inputs to publish, outputs written per transfer, first missing input or None)."""
        if not self.fused:
            missing = self.by_read_order(n for n in self.exec_specs if n not in given)
            return given, [self.all_outputs] * transfers, (missing[0] if missing else None)
        index = given.get(INDEX_NAME)
        if index is None:
            return {}, [()] * transfers, INDEX_NAME
        values = np.asarray(index).reshape(-1)
        per_unit = max(1, values.size // max(1, transfers))
        ks = [int(values[t * per_unit]) for t in range(transfers)]
        n_sub = len(self.sub_inputs)
        for k in ks:
            if not 0 <= k < n_sub:
                raise BadRequestError(f"input {INDEX_NAME!r}: expected a sub-graph number "
                                      f"0..{n_sub - 1}, got {k}")
        if len(set(ks)) > 1:
            raise BadRequestError(
                f"input {INDEX_NAME!r}: every transfer of one request must select the same "
                f"sub-graph, got {ks}; send one request per sub-graph")
        needed = [INDEX_NAME, *self.sub_inputs[ks[0]]]
        missing = self.by_read_order(n for n in needed
                                     if n not in given and n not in self.frozen)
        publish = {n: given[n] for n in needed if n in given}
        return publish, [self.sub_outputs[k] for k in ks], (missing[0] if missing else None)

    def out_samples(self, s: TensorSpec, n_units: int) -> int:
        """Samples of output ``s`` for a request of ``n_units`` (samples or transfers)."""
        if s.batch_dim is None:
            return s.batch
        return n_units if self.dynamic else n_units * s.batch

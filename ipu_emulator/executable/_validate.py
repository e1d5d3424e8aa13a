"""The executable's semantic checks: every reference (tensors, streams, graphs), size,
overlap and bound of a whole ``Executable`` (``Executable.validate``), after decoding
and before encoding. They read its fields (``Checked``: what ``Executable`` has)."""

from __future__ import annotations

from typing import Iterator, Mapping, Protocol, Sequence

from ipu_emulator.errors import ExecutableError
from ipu_emulator.executable._limits import (
    ALIGNMENT, _IPU_VERSIONS, _MAX_BYTES, _MAX_DEPTH, _MAX_NAME_BYTES, _MAX_REPEAT)
from ipu_emulator.executable._model import (
    _INDEX_DTYPES, Copy, DeviceTensor, Execute, Graph, Instruction, Program, Repeat,
    StreamIn, StreamOut, StreamSpec, Switch, _nbytes, numpy_dtype)

__all__ = ["Checked", "validate"]


class Checked(Protocol):
    """The fields of an ``Executable`` that the checks read."""

    @property
    def name(self) -> str: ...
    @property
    def package_hash(self) -> str: ...
    @property
    def ipu_version(self) -> int: ...
    @property
    def num_ipus(self) -> int: ...
    @property
    def device_iterations(self) -> int: ...
    @property
    def memory_bytes(self) -> int: ...
    @property
    def required_bytes(self) -> int: ...
    @property
    def programs(self) -> Sequence[Program]: ...
    @property
    def graphs(self) -> Sequence[Graph]: ...
    @property
    def tensors(self) -> Mapping[str, DeviceTensor]: ...
    @property
    def streams(self) -> Mapping[str, StreamSpec]: ...
    @property
    def parts(self) -> Sequence["Checked"]: ...
    @property
    def weights(self) -> bytes | memoryview: ...
    @property
    def idle(self) -> bool: ...


def validate(exe: Checked) -> None:
    """Check every reference, size and bound of ``exe``; raises ``ExecutableError``."""
    _Validator(exe).run()


def _walk(body: tuple[Instruction, ...]) -> Iterator[tuple[Instruction, int]]:
    stack = [(body, 0)]
    while stack:
        b, depth = stack.pop()
        for i in b:
            yield i, depth
            if isinstance(i, Repeat):
                stack.append((i.body, depth + 1))
            elif isinstance(i, Switch):
                stack.extend((br, depth + 1) for br in i.branches)


class _Validator:
    def __init__(self, exe: Checked) -> None:
        self.exe = exe

    def fail(self, msg: str) -> ExecutableError:
        return ExecutableError(f"executable {self.exe.name!r}: {msg}")

    def run(self) -> None:
        exe = self.exe
        if not isinstance(exe.name, str) or not exe.name or "\0" in exe.name or \
                len(exe.name.encode()) > _MAX_NAME_BYTES:
            raise self.fail(f"name must be 1..{_MAX_NAME_BYTES} UTF-8 bytes without NUL")
        if len(exe.package_hash) > 64 or not exe.package_hash.isascii():
            raise self.fail(f"package hash {exe.package_hash!r:.80} is not <= 64 ASCII characters")
        if exe.ipu_version not in _IPU_VERSIONS:
            raise self.fail(f"ipu_version {exe.ipu_version}; expected one of {_IPU_VERSIONS}")
        if not 1 <= exe.num_ipus <= 1024:
            raise self.fail(f"num_ipus {exe.num_ipus} out of range [1, 1024]")
        if not 1 <= exe.device_iterations <= _MAX_REPEAT:
            raise self.fail(f"device_iterations {exe.device_iterations} out of range")
        if not 0 <= exe.memory_bytes <= _MAX_BYTES:
            raise self.fail(f"memory_bytes {exe.memory_bytes} out of range")
        if exe.required_bytes and exe.required_bytes < exe.memory_bytes:
            raise self.fail(f"required_bytes {exe.required_bytes} < memory_bytes "
                            f"{exe.memory_bytes}")
        self._tensors()
        self._parts()
        for h, s in exe.streams.items():
            numpy_dtype(s.dtype)
            if s.direction not in ("in", "out"):
                raise self.fail(f"stream {h!r} direction {s.direction!r}; expected 'in' or 'out'")
            if s.nbytes != _nbytes(s.dtype, tuple(s.shape)):
                raise self.fail(f"stream {h!r} nbytes {s.nbytes} does not match "
                                f"{s.dtype}{list(s.shape)}")
        for k, g in enumerate(exe.graphs):
            for w in g.external:
                numpy_dtype(w.dtype)
                if w.offset < 0 or w.offset % ALIGNMENT or w.offset + w.nbytes > len(exe.weights):
                    raise self.fail(f"graph {k}: initializer {w.name!r} at [{w.offset}, "
                                    f"+{w.nbytes}) is not an aligned span of the "
                                    f"{len(exe.weights)}-byte weights section")
        for k, p in enumerate(exe.programs):
            for instr, depth in _walk(p.body):
                if depth > _MAX_DEPTH:
                    raise self.fail(f"program {k}: instructions nested deeper than {_MAX_DEPTH}")
                self._instr(k, instr)

    def _parts(self) -> None:
        exe = self.exe
        if not exe.parts:
            return
        if len(exe.parts) != exe.num_ipus:
            raise self.fail(f"{len(exe.parts)} IPU parts for num_ipus {exe.num_ipus}")
        for k, part in enumerate(exe.parts):
            if part.parts or part.num_ipus != 1 or part.ipu_version != exe.ipu_version:
                raise self.fail(f"IPU {k}'s part must be a one-IPU executable for "
                                f"ipu{exe.ipu_version} without parts of its own")
            validate(part)
            if part.idle:
                held = [what for what, n in (
                    ("graphs", len(part.graphs)), ("streams", len(part.streams)),
                    ("device tensors", len(part.tensors)),
                    ("instructions", sum(len(p.body) for p in part.programs))) if n]
                if held:
                    raise self.fail(f"IPU {k}'s part is marked idle but has {', '.join(held)}; "
                                    "an idle IPU runs nothing")
        if all(part.idle for part in exe.parts):
            raise self.fail(f"all {len(exe.parts)} IPU parts are marked idle; a multi-IPU "
                            "executable runs on at least one IPU")

    def _tensors(self) -> None:
        spans = []
        for name, t in self.exe.tensors.items():
            if name != t.name:
                raise self.fail(f"tensor key {name!r} differs from its name {t.name!r}")
            numpy_dtype(t.dtype)
            end = t.offset + t.nbytes
            if t.offset < 0 or end > self.exe.memory_bytes:
                raise self.fail(f"device tensor {name!r} at [{t.offset}, {end}) lies outside "
                                f"device memory of {self.exe.memory_bytes} bytes")
            if t.offset % ALIGNMENT:
                raise self.fail(f"device tensor {name!r} offset {t.offset} is not "
                                f"{ALIGNMENT}-byte aligned")
            if t.nbytes:
                spans.append((t.offset, end, name))
        spans.sort()
        for (a0, a1, an), (b0, _b1, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                raise self.fail(f"device tensors {an!r} and {bn!r} overlap at offset {b0}")

    def _tensor(self, k: int, name: str) -> DeviceTensor:
        t = self.exe.tensors.get(name)
        if t is None:
            raise self.fail(f"program {k} refers to unknown device tensor {name!r}")
        return t

    def _stream(self, k: int, handle: str, direction: str, t: DeviceTensor) -> None:
        s = self.exe.streams.get(handle)
        if s is None:
            raise self.fail(f"program {k} refers to unknown stream {handle!r}")
        if s.direction != direction:
            raise self.fail(f"program {k} uses stream {handle!r} as '{direction}' but it is "
                            f"'{s.direction}'")
        if s.dtype != t.dtype or s.nbytes != t.nbytes:
            raise self.fail(f"stream {handle!r} ({s.dtype}, {s.nbytes} bytes) does not match "
                            f"device tensor {t.name!r} ({t.dtype}, {t.nbytes} bytes)")

    def _instr(self, k: int, i: Instruction) -> None:
        if isinstance(i, StreamIn):
            self._stream(k, i.handle, "in", self._tensor(k, i.tensor))
        elif isinstance(i, StreamOut):
            self._stream(k, i.handle, "out", self._tensor(k, i.tensor))
        elif isinstance(i, Execute):
            if not 0 <= i.graph < len(self.exe.graphs):
                raise self.fail(f"program {k} executes graph {i.graph}; there are "
                                f"{len(self.exe.graphs)}")
            g = self.exe.graphs[i.graph]
            for kind, pairs, sigs in (("input", i.inputs, g.inputs), ("output", i.outputs, g.outputs)):
                names = [p[0] for p in pairs]
                want = [s.name for s in sigs]
                if sorted(names) != sorted(want) or len(set(names)) != len(names):
                    raise self.fail(f"program {k}: execute of graph {i.graph} binds {kind}s "
                                    f"{names}; the graph has {want}")
                by_name = {s.name: s for s in sigs}
                for onnx_name, tname in pairs:
                    t, s = self._tensor(k, tname), by_name[onnx_name]
                    if t.dtype != s.dtype or t.shape != s.shape:
                        raise self.fail(
                            f"graph {i.graph} {kind} {onnx_name!r} is {s.dtype}{list(s.shape)} "
                            f"but device tensor {tname!r} is {t.dtype}{list(t.shape)}")
            outs = [p[1] for p in i.outputs]
            if len(set(outs)) != len(outs) or set(outs) & {p[1] for p in i.inputs}:
                raise self.fail(f"program {k}: execute of graph {i.graph} writes a device "
                                f"tensor twice or writes one of its inputs: {outs}")
        elif isinstance(i, Switch):
            t = self._tensor(k, i.index)
            if t.dtype not in _INDEX_DTYPES or _count(t.shape) != 1:
                raise self.fail(f"switch index {i.index!r} must be one integer element, is "
                                f"{t.dtype}{list(t.shape)}")
            if not i.branches:
                raise self.fail(f"program {k}: switch on {i.index!r} has no branches")
        elif isinstance(i, Copy):
            a, b = self._tensor(k, i.src), self._tensor(k, i.dst)
            if a.nbytes != b.nbytes or a.name == b.name:
                raise self.fail(f"copy {a.name!r} ({a.nbytes} bytes) -> {b.name!r} "
                                f"({b.nbytes} bytes): sizes differ or same tensor")
        elif isinstance(i, Repeat):
            if not 0 <= i.count <= _MAX_REPEAT:
                raise self.fail(f"repeat count {i.count} out of range")
        else:
            raise self.fail(f"program {k}: not an instruction: {i!r:.80}")


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

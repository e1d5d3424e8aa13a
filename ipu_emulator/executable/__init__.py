"""The device executable: programs, device tensors, streams and ONNX graphs.

An executable is what the IPU process interprets. It is a small program
language over *device tensors* (named, typed regions of device memory):

- ``StreamIn(handle, tensor)``   host -> device: one transfer of a stream into a tensor
- ``StreamOut(tensor, handle)``  device -> host: one transfer of a tensor into a stream
- ``Execute(graph, inputs, outputs)`` run ONNX graph ``graph`` (index into
  ``graphs``) with its inputs bound to device tensors, writing its outputs
  into device tensors (``inputs``/``outputs`` map ONNX names to tensor names)
- ``Repeat(count, body)``        run ``body`` ``count`` times (device iterations)
- ``Switch(index, branches)``    run ``branches[value of tensor index]`` (fused models)
- ``Copy(src, dst)``             copy one device tensor into another of the same size

Programs are numbered (``programs[i]``); PopEF's program flow names which are
load, main and save.

Binary layout (all integers little-endian)::

    offset  size  field
    0       288   header (struct _HEADER, below), ends with a CRC-32 of its first 284 bytes
    288     P     program section: strict JSON (UTF-8), schema-checked on load
    288+P   G     graph section: the ONNX ModelProto bytes of every graph, concatenated;
                  each graph's (offset, length) inside this section is in the JSON; then
                  the parts of a multi-IPU executable; last, the weights section

The weights section (optional; its (offset, length) inside the graph section is
the JSON's ``weights``) holds the raw bytes of the graphs' large initializers,
each ``ALIGNMENT``-aligned from the section's start: in the ONNX graphs they are
external data, and each graph lists them (``external``: name, type, shape,
offset). So the graphs stay small (no protobuf limit of 2 GiB on the weights),
and an IPU process gives onnxruntime the weights where they lie (one read-only
copy in shared memory for every replica), without parsing or copying them. A
host may send an executable without its weights section and the section apart
(``Executable.from_bytes(head, weights=section)``, ``weights_span``).

The header alone (``read_header``: an ``ExecutableHeader``) tells a host what it needs
before loading: name, package hash of the compiling emulator, IPU version and count,
device iterations and memory sizes. The body is covered by a CRC-32 in the header.
Every size, count and reference is bounded and checked; damage raises
``ExecutableError`` naming the byte offset (never another exception).

Modules: ``_model`` (the parts: types, tensors, streams, graphs, instructions),
``_header`` (the fixed header), ``_json`` (the program section's parts, strictly read),
``_executable`` (``Executable`` and its container), ``_validate`` (the semantic checks),
``_limits`` (the bounds all of them check).
"""

from __future__ import annotations

from ipu_emulator.errors import ExecutableError
from ipu_emulator.executable._executable import Executable, body_crc32, weights_span
from ipu_emulator.executable._header import (
    FORMAT_VERSION, HEADER_SIZE, MAGIC, ExecutableHeader, read_header)
from ipu_emulator.executable._limits import ALIGNMENT
from ipu_emulator.executable._model import (
    DTYPES, IDLE_ATTR, LINK_PREFIX, ORT_TYPES, SYNC_TENSOR, Copy, DeviceTensor, Execute, ExternalWeight,
    Graph, Instruction, Program, Repeat, StreamIn, StreamOut, StreamSpec, Switch, TensorSig, is_link, is_sync, numpy_dtype, parse_link, plan_memory)

__all__ = [
    "IDLE_ATTR",
    "LINK_PREFIX",
    "SYNC_TENSOR",
    "is_link",
    "is_sync",
    "parse_link",
    "MAGIC",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "ALIGNMENT",
    "DTYPES",
    "ORT_TYPES",
    "numpy_dtype",
    "DeviceTensor",
    "StreamSpec",
    "TensorSig",
    "Graph",
    "StreamIn",
    "StreamOut",
    "Execute",
    "Repeat",
    "Switch",
    "Copy",
    "Instruction",
    "Program",
    "Executable",
    "ExecutableError",
    "plan_memory",
    "read_header",
    "ExecutableHeader",
    "ExternalWeight",
    "weights_span",
    "body_crc32",
]

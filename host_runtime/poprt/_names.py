"""Names PopRT's own code and examples share (``from poprt._names import ...``)."""

from __future__ import annotations

__all__ = ["sHostConcatRunnerConfig"]

sHostConcatRunnerConfig = "HostConcatRunnerConfig"
"""Key of the ONNX metadata entry ``apply_host_concat_split`` writes and of the PopEF
opaque blob ``HostConcatRunner`` reads: JSON, a list of ``{tensor_name,
input_tensor_names, shape, data_size_bytes}``, one per merged input."""

"""PopEF: the model file format (data model, reader, writer, model builder).

Spelled as the seeds' Python listings use it::

    from host_runtime import popef
    reader = popef.Reader()
    reader.parseFile(path)
    model = popef.ModelBuilder(reader).createModel()
    for anchor in model.metadata.anchors(): ...

and as Graphcore's ``popef`` module has it (``ipu-emulator run`` maps ``import popef`` here):
the blob readers ``Reader.executables()``/``tensors()``/``feeds()``/``opaqueBlobs()``, the
blob writers ``Writer.createExecutable``/``createTensorData``/``createFeedData``/
``createOpaqueBlob``, ``TensorDataInfo``, ``FeedDataInfo``, ``popefTypeToNumpyDType``,
``numpyDTypeToPopefType`` (``host_runtime.popef.blobs``).
"""

from host_runtime.popef._format import BlobType
from host_runtime.popef.blobs import (BlobWriter, ExecutableReader, FeedDataInfo, FeedReader,
                                      OpaqueReader, TensorDataInfo, TensorReader,
                                      numpyDTypeToPopefType, popefTypeToNumpyDType)
from host_runtime.popef.builder import ModelBuilder, load_model
from host_runtime.popef.model import (Anchor, DataType, ExecutableBlob, FeedData, Metadata,
                                      Model, Opaque, Option, ProgramFlow, TensorData,
                                      TensorInfo, TensorType)
from host_runtime.popef.reader import BlobInfo, Reader
from host_runtime.popef.writer import Writer, save_model

# for the other packages of host_runtime (not part of the public surface)
from host_runtime.popef._check import check_model as check_model
from host_runtime.popef._check import decoded_programs as decoded_programs
from host_runtime.popef._cache import files_key as files_key, keep_model as keep_model, kept_model as kept_model

__all__ = [
    "Anchor",
    "BlobInfo",
    "BlobType",
    "BlobWriter",
    "DataType",
    "ExecutableBlob",
    "ExecutableReader",
    "FeedData",
    "FeedDataInfo",
    "FeedReader",
    "Metadata",
    "Model",
    "ModelBuilder",
    "Opaque",
    "OpaqueReader",
    "Option",
    "ProgramFlow",
    "Reader",
    "TensorData",
    "TensorDataInfo",
    "TensorInfo",
    "TensorReader",
    "TensorType",
    "Writer",
    "load_model",
    "numpyDTypeToPopefType",
    "popefTypeToNumpyDType",
    "save_model",
]

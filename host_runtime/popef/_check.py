"""The model check: a model's executable against its metadata (rules in ipu_emulator.validate).

``check_model`` decodes the executable and applies ``ipu_emulator.validate.check_model``
to the metadata's anchors and program flow; a file that breaks a rule is refused
with a ``PopefError`` that names the rule, the program or anchor and what was found.
A model that passed is remembered (the check runs once per ``Model`` object).
"""

from __future__ import annotations

from host_runtime.errors import ModelRuleError, PopefError
from host_runtime.popef.model import ExecutableBlob, Model, TensorType
from ipu_emulator.errors import ExecutableError
from ipu_emulator.executable import MAGIC, Executable
from ipu_emulator.validate import AnchorSpec, FlowSpec, RuleError
from ipu_emulator.validate import check_model as _check_rules
from shm.errors import echo

__all__ = ["check_model", "decoded_programs"]

_CHECKED = "_rules_checked"
_DECODED = "_decoded_programs"


def decoded_programs(blob: ExecutableBlob) -> Executable:
    """``Executable.from_bytes(blob.payload(), graphs=False)`` (its programs, streams and
    attributes; no graphs), decoded once per blob and its bytes: the model check, the
    runner's read order and host tail each read it at construction. Kept on the blob
    while ``blob.data`` is the same immutable object (bytes, or a read-only view such as
    ``popef.Reader``'s of a file mapping); raises as ``from_bytes`` does."""
    data = blob.data
    memo = getattr(blob, _DECODED, None)
    if memo is not None and memo[0] is data and memo[1] == blob.compressed:
        kept: Executable = memo[2]
        return kept
    exe = Executable.from_bytes(blob.payload(), graphs=False)
    if isinstance(data, bytes) or (isinstance(data, memoryview) and data.readonly):
        setattr(blob, _DECODED, (data, blob.compressed, exe))
    return exe
_DIRECTION = {TensorType.INPUT: "in", TensorType.OUTPUT: "out", TensorType.UNKNOWN: None}


def check_model(model: Model, *, path: str | None = None, blob: str | None = None,
                strict: bool = True) -> None:
    """Refuse ``model`` with a ``PopefError`` if its executable, anchors and program flow
    disagree (``path``/``blob`` say where the metadata came from, for the message).

    Not ``strict`` (``ModelBuilder``, ``popef_dump``: PopEF as a file format), an
    executable that cannot be decoded (another magic, damaged) is left to the runtime,
    which refuses it when it loads the model; the rules apply to those that decode.
    """
    if getattr(model, _CHECKED, False):
        return
    md = model.metadata
    name = model.executable.name()
    payload = model.executable.payload()
    if not strict and not bytes(payload[:len(MAGIC)]) == MAGIC:
        return
    try:
        # the PopEF blob checksum covers these bytes; the IPU process decodes them fully
        exe = decoded_programs(model.executable)
    except ExecutableError as exc:
        if not strict:
            return
        raise PopefError(f"executable {echo(name)} cannot be decoded: {exc}", path=path,
                         blob=f"executable {echo(name)}") from None
    anchors = []
    for a in md.anchors():
        info = a.tensorInfo()
        try:
            dtype = info.dataType().value
            nbytes = info.sizeInBytes()
        except Exception as exc:   # FP8: no numpy type
            raise PopefError(f"anchor {echo(a.name())}: {exc}", path=path, blob=blob) from None
        anchors.append(AnchorSpec(a.name(), a.handle(), _DIRECTION[a.type()], dtype,
                                  tuple(info.shape()), nbytes, tuple(a.programs())))
    flow = md.programFlow()
    try:
        _check_rules(exe, anchors, FlowSpec(tuple(flow.load()), tuple(flow.main()),
                                            tuple(flow.save())), md.subgraphs())
    except RuleError as exc:
        raise ModelRuleError(f"model {echo(md.executable())} is inconsistent: {exc}",
                             rule=exc.rule, path=path, blob=blob) from None
    setattr(model, _CHECKED, True)

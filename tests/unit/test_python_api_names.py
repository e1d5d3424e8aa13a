"""Every public name of Graphcore's Python modules resolves as a program imports it.

``tests/reference/python_api.tsv`` lists the names of ``model_runtime``, ``popef`` and
``poprt`` (module, dotted name, kind, signature, public source). Each is looked up the
way an unchanged program reaches it: through ipu_emulator.run's mapping (``import popef``;
``popef.Reader.parseFile``), as a module attribute, a submodule, a class attribute, a
dataclass field, a slot or, last, an attribute of an instance made with no arguments
(``tools.api_table.resolve``, which docs/python_api.md is generated with).

One test per module of the table (``-k popef``, ``-k "poprt and runtime"``), reporting
every name of it that does not resolve. PENDING lists the modules whose names other
work of issue 29 is adding (strict xfail: an entry whose names all resolve fails, so the
list only shrinks).
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from ipu_emulator import run
from tools.api_table import resolve, rows


def modules() -> list[str]:
    return sorted({r["module"] for r in rows()})


# module -> who adds its names (issue 29's other parts); remove an entry once they resolve
_COMPILE = "PopRT's compile side (compiler, Converter, passes, Backend), its own issue"
PENDING: dict[str, str] = {
    **{m: _COMPILE for m in (
        "poprt", "poprt.backend", "poprt.backends", "poprt.compiler", "poprt.converter",
        "poprt.frontend", "poprt.passes", "poprt.profile", "poprt.quantizer", "poprt.utils")},
    **{"poprt.passes." + m: _COMPILE for m in (
        "add_checkpoints", "apply_host_concat_split", "apply_ir_pass", "attention_padding",
        "auto_insert_remap", "check_unspported_attribute", "check_with_fake_data",
        "compress_pattern", "const_batch_size", "const_input_shape", "constant_folding",
        "double_to_float", "eight_bits_io", "erf_gelu_pattern", "expand_if",
        "fill_squeeze_axes", "final_check", "float_to_fp8", "float_to_half",
        "float_to_int8", "float_to_mixed", "fold_periodic_initializer", "fuse_bn_into_gemm",
        "fuse_cast_into_onehot", "fuse_mul_into_matmul", "fused_attention", "gelu_pattern",
        "insert_attention_mask", "int64_to_int32", "layer_norm_pattern",
        "layer_precision_compare", "manual_sharding", "matmul_rotary_embedding",
        "merge_if_with_same_cond", "merge_matmul", "merge_matmul_add", "merge_moe",
        "merge_multi_slice", "merge_variant_if", "model_io_info_overview", "model_overview",
        "move_subgraph_initializer", "onnx_helper", "overlap_io", "packed_transformer",
        "post_expand", "pre_scale", "remove_duplicated_initializer",
        "remove_initializer_from_input", "remove_input_cast", "remove_outputs",
        "replace_bn_with_mul_add", "replace_castlike", "replace_clip_empty_inputs",
        "replace_consecutive_cast_with_notzero", "replace_div_with_mul",
        "replace_erf_with_erfv2", "replace_gemm_with_matmul", "replace_greater_or_equal",
        "replace_groupnorm_with_fast_norm", "replace_half_reducemean", "replace_hardswish",
        "replace_isinf", "replace_less_or_equal", "replace_nonzero", "replace_pow",
        "replace_round", "replace_softmax", "replace_where_mask",
        "replace_where_with_mul_add", "replace_where_with_wherev2", "serialize_matmul",
        "serialize_matmul_add", "shape_inference", "sort_graph", "workarounds")},
}

@pytest.fixture(scope="module", autouse=True)
def mapped() -> Iterator[None]:
    was = run.installed()
    run.install()
    yield
    if not was:
        run.uninstall()


def _params() -> list[Any]:
    return [pytest.param(m, id=m, marks=pytest.mark.xfail(strict=True, reason=PENDING[m]))
            if m in PENDING else m for m in modules()]


@pytest.mark.parametrize("module", _params())
def test_every_name_resolves(module: str) -> None:
    missing = [f"{r['name']}: {why}" for r in rows() if r["module"] == module
               for _, why in [resolve(module, r["name"])] if why is not None]
    assert not missing, f"{len(missing)} names of {module} do not resolve:\n  " + \
        "\n  ".join(missing)


def test_the_table_is_whole() -> None:
    table = rows()
    assert len(table) == 609
    assert {r["module"].split(".")[0] for r in table} == {"model_runtime", "popef", "poprt"}
    assert all(r["name"] and r["kind"] for r in table)
    assert set(PENDING) <= set(modules())

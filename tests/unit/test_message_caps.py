"""Every error message is capped in length: values echoed from user input are shortened
(shm.errors.echo: head...tail and the total size), so no error line grows with its input:
a 7 MB input shape, a 1 MB config value, 50000 unknown keys, a 100000-character tensor
name each give a line of a few hundred characters, at once."""

from __future__ import annotations

import time

import onnx
import pytest

from host_runtime import popef
from host_runtime.errors import BadRequestError
from host_runtime.poprt.compiler import load_config_yaml, parse_input_shape
from ipu_emulator.compiler import load_sharding_yaml
from ipu_emulator.errors import CompileError, SystemConfigError
from ipu_emulator.system import load_system_config
from shm.errors import echo
from tests.models import SEED_FUSION_CONFIG
from tools.generate_simple_popef import build_simple_model
from tools.poprt import main as poprt

MAX = 600          # characters of one message
HUGE = "9" * 7_000_000


@pytest.fixture()
def onnx_path(tmp_path):
    p = tmp_path / "simple.onnx"
    onnx.save(build_simple_model((1, 4)), str(p))
    return p


def _line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err[:3000]
    return lines[0]


def test_echo_shortens_text_and_says_how_long():
    assert echo("abc") == "'abc'"
    assert echo("abc", quote=False) == "abc"
    s = "a" * 50 + "b" * 100 + "c" * 50
    short = echo(s)
    assert short.startswith("'" + "a" * 50 + "b") and short.endswith("c" * 26 + "' (200 chars)")
    assert "..." in short and len(short) < 110
    assert echo(b"\xff" * 1000).endswith("' (1000 bytes)")
    assert echo(s, quote=False).endswith("c" * 26 + " (200 chars)")


def test_echo_of_containers_is_bounded_in_time_and_length():
    nested: list = ["lol"] * 9
    for _ in range(9):
        nested = [nested] * 9            # 9**10 strings, if walked
    t0 = time.monotonic()
    text = echo(nested)
    assert time.monotonic() - t0 < 10   # ~1 ms; walking all would take hours
    assert text.endswith(" (9 items)") and len(text) < 120
    assert echo(list(range(10 ** 6))) == "[0, 1, 2, 3, 4, 5, 6, 7, ...] (1000000 items)"
    assert echo({"a": 1}) == "{'a': 1}"
    assert echo(7) == "7"

    class Broken:
        def __repr__(self):
            raise RuntimeError("no")
    assert echo(Broken()).startswith("<Broken instance at 0x")   # reprlib's stand-in


def test_poprt_huge_input_shape(onnx_path, capsys):
    t0 = time.monotonic()
    assert poprt(["--input_model", str(onnx_path), "--input_shape", "X=" + HUGE]) == 2
    line = _line(capsys)
    assert line.startswith("poprt: error: input shape 'X=99999")
    assert line.endswith("' (7000002 chars): dims must be integers")
    assert len(line) < MAX and time.monotonic() - t0 < 5


def test_poprt_usage_error_is_capped(onnx_path, capsys):
    with pytest.raises(SystemExit) as info:
        poprt(["--input_model", str(onnx_path), "--batches_per_step", HUGE])
    assert info.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("poprt: error: argument --batches_per_step: invalid int value: '999")
    assert last.endswith("' (7000050 chars)") and len(last) < 1100


def test_poprt_unknown_input_name(onnx_path, capsys):
    name = "Q" * 100_000
    assert poprt(["--input_model", str(onnx_path), "--input_shape", f"{name}=1,4"]) == 2
    line = _line(capsys)
    assert "--input_shape names 'QQQQ" in line and "(100000 chars), which is not an input" in line
    assert len(line) < MAX


def test_config_values_are_capped(tmp_path):
    long = "x" * 900_000
    cases = [
        (f"input_shape: ['{long}']\n", "input shape 'xxxx"),
        (f"name: [{', '.join(['1'] * 90_000)}]\n", "name must be a str, got [1, 1, 1"),
        ("".join(f"k{i}: 1\n" for i in range(40_000)), "unknown keys ['k0', 'k1', 'k10'"),
        (f"model_fusion: [{{input_model: m.onnx, precision: [{long!r}]}}]\n",
         "precision must be a str, got ['xxxx"),
        (f"popef_name: '../{long}'\n", "popef_name '../xxxx"),
    ]
    for k, (text, words) in enumerate(cases):
        cfg = tmp_path / f"c{k}.yaml"
        cfg.write_text(_with(text))
        with pytest.raises(BadRequestError) as info:
            load_config_yaml(cfg)
        msg = str(info.value)
        assert words in msg and len(msg) < MAX, (k, msg[:2000])


def _with(line: str) -> str:
    """The seed's config with ``line``'s key replaced."""
    key = line.split(":", 1)[0]
    kept = [ln for ln in SEED_FUSION_CONFIG.splitlines() if not ln.startswith(key + ":")]
    if key == "model_fusion":
        kept = [ln for ln in kept if not ln.startswith(" ")]
    return "\n".join(kept) + "\n" + line


def test_sharding_and_system_config_values_are_capped(tmp_path, monkeypatch):
    shard = tmp_path / "s.yaml"
    shard.write_text("sharding_info:\n  ? " + "N" * 500_000 + "\n  : -1\n")
    with pytest.raises(CompileError) as info:
        load_sharding_yaml(shard)
    msg = str(info.value)
    assert "'NNNN" in msg and "(500000 chars): -1 must be a node name" in msg and len(msg) < MAX
    with pytest.raises(SystemConfigError) as sinfo:
        load_system_config({"IPU_EMULATOR_NUM_IPUS": "x" * 1_000_000,
                            "IPU_EMULATOR_HOME": str(tmp_path / "home")})
    msg = str(sinfo.value)
    assert msg.startswith("IPU_EMULATOR_NUM_IPUS='xxx") and len(msg) < MAX
    assert msg.endswith("(1000000 chars): expected an integer in 0..64")


def test_parse_input_shape_and_popef_names_are_capped(tmp_path):
    with pytest.raises(BadRequestError) as info:
        parse_input_shape("=" + "1," * 1_000_000)
    assert len(str(info.value)) < MAX
    with popef.Writer(tmp_path / "f.popef") as w:
        with pytest.raises(BadRequestError) as winfo:
            w.writeFeedData("A" * 1_000_000, b"123", num_transfers=2)
        assert str(winfo.value).startswith("feed data for 'AAAA")
        assert "(1000000 chars): 3 bytes is not a whole number of 2 transfers" in str(winfo.value)
        assert len(str(winfo.value)) < MAX

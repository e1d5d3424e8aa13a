"""Hostile YAML configs are refused cheaply, by the one loader (ipu_emulator.yaml_config),
with one short error line: alias bombs, recursive aliases, deep nesting, huge scalars."""

from __future__ import annotations

import pathlib
import re
import time

import onnx
import pytest
import yaml

from host_runtime.errors import BadRequestError
from host_runtime.poprt.compiler import load_config_yaml
from ipu_emulator.compiler import load_sharding_yaml
from ipu_emulator import yaml_config
from ipu_emulator.errors import CompileError, ConfigYamlError, SystemConfigError
from ipu_emulator.system import load_system_config
from ipu_emulator.yaml_config import MAX_NODES, load_yaml_file, load_yaml_text
from tests.models import SEED_FUSION_CONFIG, seed_model0, seed_model1
from tools.poprt import main as poprt

ROOT = pathlib.Path(__file__).resolve().parents[2]
BOUND = 10.0         # seconds; the bomb is refused in ~1 ms, expanding it takes hours
MAX_LINE = 600       # characters of one error line


def _bomb(key: str = "input_shape", levels: int = 9) -> str:
    """A 'billion laughs': ``levels`` anchors of nine aliases each (9**levels values)."""
    doc = f"{key}:\n - &a0 [lol,lol,lol,lol,lol,lol,lol,lol,lol]\n"
    for k in range(1, levels):
        doc += f" - &a{k} [" + ",".join([f"*a{k - 1}"] * 9) + "]\n"
    return doc


def _fusion_dir(tmp_path: pathlib.Path, config: str) -> pathlib.Path:
    d = tmp_path / "fusion"
    d.mkdir()
    onnx.save(seed_model0(), str(d / "model0.onnx"))
    onnx.save(seed_model1(), str(d / "model1.onnx"))
    cfg = d / "config.yaml"
    cfg.write_text(config)
    return cfg


def test_bomb_is_small():
    assert len(_bomb().encode()) < 600


@pytest.mark.parametrize("key", ["input_shape", "name", "sharding_info"])
def test_poprt_refuses_an_alias_bomb_at_once(tmp_path, capsys, key):
    cfg = _fusion_dir(tmp_path, SEED_FUSION_CONFIG + _bomb(key))
    t0 = time.monotonic()
    assert poprt(["--config_yaml", str(cfg)]) == 2
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[:2000]
    assert lines[0] == (f"poprt: error: config {str(cfg)!r}: its aliases expand past "
                        f"{MAX_NODES} values at line 20, column 4 (a 'billion laughs' "
                        "document?); expected a config of plain values: write them out "
                        "instead of repeating aliases")
    assert len(lines[0]) < MAX_LINE
    assert took < BOUND, took


def test_every_loader_refuses_the_bomb(tmp_path, monkeypatch):
    fusion = tmp_path / "fusion.yaml"
    fusion.write_text(SEED_FUSION_CONFIG + _bomb("input_shape"))
    shard = tmp_path / "shard.yaml"
    shard.write_text(_bomb("sharding_info"))
    machine = tmp_path / "machine.yaml"
    machine.write_text(_bomb("num_ipus"))
    t0 = time.monotonic()
    with pytest.raises(BadRequestError, match=r"^config '.*fusion.yaml': its aliases expand "
                       f"past {MAX_NODES} values at line 20, column 4"):
        load_config_yaml(fusion)
    with pytest.raises(CompileError, match=r"^sharding config '.*shard.yaml': its aliases "
                       f"expand past {MAX_NODES} values at line 7, column 4"):
        load_sharding_yaml(shard)
    with pytest.raises(SystemConfigError, match=r"^IPU_EMULATOR_CONFIG file '.*machine.yaml': "
                       f"its aliases expand past {MAX_NODES} values at line 7, column 4"):
        load_system_config({"IPU_EMULATOR_CONFIG": str(machine), "IPU_EMULATOR_HOME":
                            str(tmp_path / "home")})
    assert time.monotonic() - t0 < 3 * BOUND


def test_a_few_aliases_still_work(tmp_path):
    """An anchor that repeats an input_shape is fine: its expansion is small."""
    config = SEED_FUSION_CONFIG.replace("input_shape: ['X=1,2', 'Y=1,2']",
                                        "input_shape: &s0 ['X=1,2', 'Y=1,2']")
    config = config.replace("input_shape: ['X=1,1']", "input_shape: *s0")
    cfg = _fusion_dir(tmp_path, config)
    specs = load_config_yaml(cfg).models
    assert [s.input_shapes for s in specs] == [{"X": [1, 2], "Y": [1, 2]}] * 2


def test_expansion_just_under_the_bound_is_read():
    # 9**5 = 59049 strings (+ the lists): under MAX_NODES
    value = load_yaml_text(_bomb("k", 5), "doc")
    assert len(value["k"][4]) == 9 and value["k"][4][0][0][0][0] == ["lol"] * 9
    with pytest.raises(ConfigYamlError, match=f"expand past {MAX_NODES} values"):
        load_yaml_text(_bomb("k", 6), "doc")


def test_too_many_values_without_aliases():
    with pytest.raises(ConfigYamlError) as info:
        load_yaml_text("k: [" + "1, " * MAX_NODES + "]", "doc")
    assert str(info.value) == (f"doc: holds more than {MAX_NODES} values (at line 1, column 4); "
                               "expected a config (tens to thousands of values)")


def test_recursive_alias_is_refused():
    with pytest.raises(ConfigYamlError) as info:
        load_yaml_text("a: &x [1, *x]\n", "doc")
    assert str(info.value) == ("doc: the alias *x at line 1, column 11 refers to a node that "
                               "contains it (a recursive structure); expected plain values")


def test_deep_nesting_is_refused_without_recursion():
    with pytest.raises(ConfigYamlError) as info:
        load_yaml_text("k: " + "[" * 100000 + "]" * 100000, "doc")
    assert str(info.value) == "doc: nests too deeply: more than 64 levels at line 1, column 67"


def test_unreadable_scalar_is_named():
    with pytest.raises(ConfigYamlError) as info:
        load_yaml_text("a: 1\nb: " + "9" * 5000 + "\n", "doc")
    msg = str(info.value)
    assert msg.startswith("doc holds a value that cannot be read at line 2, column 4: "
                          "Exceeds the limit (4300 digits)"), msg
    assert len(msg) < MAX_LINE


def test_invalid_yaml_message_is_capped(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("a: [" + "x, " * 200000 + "\n: :")
    with pytest.raises(ConfigYamlError) as info:
        load_yaml_file(p)
    msg = str(info.value)
    assert msg.startswith(f"config {str(p)!r} is not valid YAML: "), msg
    assert len(msg) < MAX_LINE


def test_size_limit(tmp_path):
    p = tmp_path / "big.yaml"
    p.write_bytes(b"#" * ((1 << 20) + 1))
    with pytest.raises(ConfigYamlError, match=r"is 1048577 bytes; the limit is 1048576$"):
        load_yaml_file(p, "config")


def test_yaml_is_parsed_only_by_the_one_loader():
    """No module but ipu_emulator/yaml_config.py parses YAML (dumping is fine)."""
    parse = re.compile(r"\byaml\.(safe_load|load|full_load|unsafe_load|load_all|safe_load_all|"
                       r"compose|parse|SafeLoader|Loader|FullLoader|CSafeLoader|CLoader)\b")
    found = []
    for pkg in ("shm", "ipu_emulator", "host_runtime", "tools"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name == "yaml_config.py" and path.parent.name == "ipu_emulator":
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if parse.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []


class _RefusingLibyaml(yaml.SafeLoader):
    """A YAML parser that, like libyaml since PyYAML 6.0.4, refuses deep nesting while it
    scans ahead, before handing out the events our count reads."""

    def check_event(self, *choices):   # type: ignore[no-untyped-def]
        raise yaml.scanner.ScannerError("while increasing flow level", None,
                                        "exceeded maximum nesting depth", None)


def test_our_nesting_bound_speaks_first_whatever_the_parser(monkeypatch):
    monkeypatch.setattr(yaml_config, "_Parser", _RefusingLibyaml)
    with pytest.raises(ConfigYamlError) as info:
        load_yaml_text("k: " + "[" * 100000 + "]" * 100000, "doc")
    assert str(info.value) == "doc: nests too deeply: more than 64 levels at line 1, column 67"
    # a shallow document that the parser refuses is reported as invalid, as before
    with pytest.raises(ConfigYamlError, match=r"^doc is not valid YAML: exceeded maximum "):
        load_yaml_text("k: [[1]]", "doc")

"""How a timeline file is written: names as UTF-8 text, which every reader decodes alike."""

from __future__ import annotations

import json

from ipu_emulator import trace


def test_names_are_written_as_utf8_not_as_escapes(tmp_path):
    # Perfetto's JSON reader keeps a \\uXXXX escape as it is: "ipu 0 · pid 7" would show
    # as "ipu 0 \\u00b7 pid 7" in its UI
    name = "ipu 0 · pid 7 · host 5 runner 1 · model m\u00e9 · replica 0"
    path = tmp_path / "t.json"
    trace.write({"traceEvents": [{"ph": "M", "name": "process_name", "pid": 7,
                                  "args": {"name": name}}]}, str(path))
    raw = path.read_bytes()
    assert b"\\u" not in raw
    assert name.encode("utf-8") in raw
    assert json.loads(raw.decode("utf-8"))["traceEvents"][0]["args"]["name"] == name


def test_a_name_that_is_no_text_is_written_readable(tmp_path):
    # a thread name with a lone surrogate (os.fsdecode of a bad byte) still makes a file
    path = tmp_path / "t.json"
    trace.write({"traceEvents": [{"ph": "M", "name": "thread_name", "pid": 7, "tid": 7,
                                  "args": {"name": "worker \udcff"}}]}, str(path))
    name = json.loads(path.read_bytes().decode("utf-8"))["traceEvents"][0]["args"]["name"]
    assert name.startswith("worker ") and len(name) == 8


def test_a_trace_that_cannot_be_written_leaves_the_blocks_own_exception(tmp_path, caplog):
    import pytest

    (tmp_path / "afile").write_text("")
    target = str(tmp_path / "afile" / "x.json")
    with pytest.raises(ValueError, match="mine"):
        with trace.tracing(target):
            raise ValueError("mine")
    assert "could not write the trace of a block that raised" in caplog.text
    with pytest.raises(NotADirectoryError, match="a folder of the trace's path is a file"):
        with trace.tracing(target):   # no exception of its own: the writer's is the one
            pass

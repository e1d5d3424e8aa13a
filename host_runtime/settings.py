"""The settings of the runtime: every knob of every layer, and how to change them.

:class:`Settings` (``HostSettings``) holds the host's knobs and, inherited, those
of the IPU processes (``ipu_emulator.settings.IpuSettings``) and of the rings
(``shm.settings.ShmSettings``). Each knob is an ``IPU_EMULATOR_*`` variable;
README.md's Settings section lists them all (``python -m host_runtime.settings``
prints that table).

Reading and changing them::

    from host_runtime import settings

    settings.current().host_sync_timeout          # 60.0: the environment's, or an override's
    with settings.override(host_sync_timeout=2.0, device_spin_us=0):
        runner = ModelRunner("model.popef")       # keeps these for its life
    manager = DeviceManager(settings=settings.current().replace(start_timeout=30))

A runner, session, device manager or daemon takes the settings when it is made
(``current()``, or the ``settings=`` it is given) and passes them to what it
makes: its devices, their IPU processes (through their environment), its rings.
The knobs that say which machine (home, shared-memory tag, daemon, IPU count...)
are read at each use instead.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ipu_emulator.settings import IpuSettings
from shm.settings import (EACH_USE, SettingsError, flag, knob, micros, override, readme_table,
                          seconds, text)

__all__ = ["Settings", "HostSettings", "SettingsError", "current", "override", "table"]

_HOST = "a runner, session or device is made"


@dataclass(frozen=True)
class HostSettings(IpuSettings):
    """Every knob: the host's, and (inherited) those of the IPU processes and the rings."""

    runner_spin_us: float = knob(
        100.0, "IPU_EMULATOR_RUNNER_SPIN_US", micros,
        "the host's poll of an output ring before it blocks, while recent outputs came "
        "quickly (with requests queued behind it: not while its CPU is shared); 0: never "
        "poll", when="a runner is made")
    runner_fused: bool = knob(
        True, "IPU_EMULATOR_RUNNER_FUSED", flag,
        "`0`: a plain `execute` on an idle replica takes the general request path (a "
        "request, a transfer, a drain) instead of the fused write-wait-read under one lock",
        when="a runner is made")
    runner_plain: bool = knob(
        True, "IPU_EMULATOR_RUNNER_PLAIN", flag,
        "`0`: the common request (a dict of whole arrays of every input's dtype and shape) "
        "is checked and built like any other instead of recognised at once",
        when="a runner is made")
    runner_small_io: bool = knob(
        True, "IPU_EMULATOR_RUNNER_SMALL_IO", flag,
        "`0`: small transfers are written and read through a ring slot like large ones, "
        "instead of one ring call each that copies and publishes (or releases)",
        when="a runner is made")
    load_timeout: float = knob(
        300.0, "IPU_EMULATOR_LOAD_TIMEOUT", seconds,
        "how long loading an executable onto a device may take", when=_HOST)
    stop_timeout: float = knob(
        30.0, "IPU_EMULATOR_STOP_TIMEOUT", seconds,
        "how long a session's stop or close waits for its device's main loop", when=_HOST)
    host_sync_timeout: float = knob(
        60.0, "IPU_EMULATOR_HOST_SYNC_TIMEOUT", seconds,
        "the longest any host call waits on a device or daemon that makes no progress (a "
        "stopped or stuck peer) before it fails with a named error (modelled on Poplar's "
        "`target.hostSyncTimeout`)", when=f"{_HOST}, or a queue")
    daemon: str | None = knob(
        None, "IPU_EMULATOR_DAEMON", text(shown="a socket's path"),
        "socket of a daemon whose IPUs a `DeviceManager` attaches (`DeviceManager(daemon=...)` "
        "for one)", when=EACH_USE, shown="none: IPU processes of your own")


Settings = HostSettings
"""The settings class of the runtime (all knobs)."""


def current() -> HostSettings:
    """The settings now: the environment's, with the active :func:`override` blocks on top."""
    return HostSettings.current()


def table() -> str:
    """README.md's table of every knob (its rows)."""
    return readme_table(HostSettings)


if __name__ == "__main__":  # pragma: no cover
    sys.stdout.write(table() + "\n")


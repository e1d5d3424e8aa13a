"""Process titles: what ps and top show for the processes of the emulator.

Each process the emulator starts sets its title (with ``setproctitle``, which
rewrites ``/proc/PID/cmdline``), so that a user can tell them apart::

    ipu-emulator: daemon                          ipu-emulator daemon
    ipu-emulator: fork server (host 1234)         the template forking host 1234's IPUs
    ipu-emulator: ipu 3 (host 1234)               IPU 3, started by host 1234
    ipu-emulator: ipu 3 (daemon 99, free)         IPU 3 of daemon 99, held by no host
    ipu-emulator: ipu 3 (host 1234, daemon 99)    IPU 3 of daemon 99, lent to host 1234

Only processes of the emulator's own are titled, never a host's.
"""

from __future__ import annotations

import os
import re

__all__ = ["DAEMON", "PREFIX", "fork_server", "ipu", "parse_ipu", "of_pid", "set_title",
           "title"]

PREFIX = "ipu-emulator: "
DAEMON = PREFIX + "daemon"


def fork_server(host_pid: int) -> str:
    """The title of the template process that forks ``host_pid``'s IPU processes."""
    return f"{PREFIX}fork server (host {host_pid})"


def ipu(ipu_id: int, host_pid: int, daemon_pid: int = 0) -> str:
    """The title of IPU process ``ipu_id`` serving ``host_pid`` (0: none), owned by
    ``daemon_pid`` (0: started by its host)."""
    if not daemon_pid:
        return f"{PREFIX}ipu {ipu_id} (host {host_pid})"
    if not host_pid:
        return f"{PREFIX}ipu {ipu_id} (daemon {daemon_pid}, free)"
    return f"{PREFIX}ipu {ipu_id} (host {host_pid}, daemon {daemon_pid})"


_IPU = re.compile(r"ipu-emulator: ipu (-?\d+) \((?:host (\d+))?(?:, )?(?:daemon (\d+))?"
                  r"(?:, free)?\)$")


def parse_ipu(title: str) -> tuple[int, int, int] | None:
    """``(ipu_id, host_pid, daemon_pid)`` of an IPU process's title (0: none), or None
    if ``title`` is not one."""
    m = _IPU.match(title.strip())
    if m is None:
        return None
    return int(m[1]), int(m[2] or 0), int(m[3] or 0)


def of_pid(pid: int) -> str | None:
    """The command line of process ``pid`` as ps shows it (its title once set), or None
    if there is no such process."""
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            raw = f.read(4096)
    except OSError:
        return None
    # a title may leave the rest of the old command line's space as NULs or spaces
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").rstrip()


def set_title(text: str) -> None:
    """Set this process's title to ``text``.

    Within the space of the process's original command line: ``setproctitle`` would
    otherwise move the environment to make room, and ``/proc/PID/environ`` (which
    ``ps e`` and psutil read) would no longer show it.
    """
    import setproctitle   # only processes that title themselves load it

    mine = "SPT_NOENV" not in os.environ
    if mine:
        os.environ["SPT_NOENV"] = "1"   # read by setproctitle's first call
    try:
        setproctitle.setproctitle(text)
    finally:
        if mine:
            os.environ.pop("SPT_NOENV", None)


def title() -> str:
    """This process's title (its command line until :func:`set_title`)."""
    import setproctitle

    return str(setproctitle.getproctitle())

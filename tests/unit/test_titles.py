"""ipu_emulator.titles: the titles ps shows, and reading them back."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from ipu_emulator import titles


def test_titles_read_back() -> None:
    assert titles.ipu(3, 1234) == "ipu-emulator: ipu 3 (host 1234)"
    assert titles.fork_server(1234) == "ipu-emulator: fork server (host 1234)"
    assert titles.DAEMON == "ipu-emulator: daemon"
    assert titles.parse_ipu(titles.ipu(3, 1234)) == (3, 1234, 0)
    assert titles.parse_ipu(titles.ipu(-1, 0, 99)) == (-1, 0, 99)
    assert titles.parse_ipu(titles.ipu(0, 5, 99) + "   ") == (0, 5, 99)
    assert titles.parse_ipu(titles.fork_server(5)) is None
    assert titles.parse_ipu("python -m ipu_emulator --ipu-id 3") is None
    assert titles.of_pid(1 << 30) is None


def test_set_title_keeps_the_environment_readable() -> None:
    code = textwrap.dedent("""
        import os
        from ipu_emulator import titles
        titles.set_title("ipu-emulator: ipu 7 (host 1)")
        print(titles.of_pid(os.getpid()))
        print(b"TITLE_PROBE=yes" in open(f"/proc/{os.getpid()}/environ", "rb").read())
        print("SPT_NOENV" in os.environ)
    """)
    out = subprocess.run([sys.executable, "-c", code, "-" * 60], capture_output=True,
                         text=True, env=dict(os.environ, TITLE_PROBE="yes"), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["ipu-emulator: ipu 7 (host 1)", "True", "False"]

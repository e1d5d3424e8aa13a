"""``poprt``, the command (its console script): ``host_runtime.poprt.cli``, where it lives
so that ``python -m poprt.cli`` (PopRT 1.0.2's spelling) runs it under ``ipu-emulator run``.
"""

from __future__ import annotations

import sys

from host_runtime.poprt.cli import build_parser, main

__all__ = ["main", "build_parser"]

if __name__ == "__main__":
    sys.exit(main())

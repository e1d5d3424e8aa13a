"""Files written whole or not at all, never through a link: the host's name for
``ipu_emulator.safe_files.AtomicFile`` (one implementation, described there), which
``poprt`` and the PopEF ``Writer`` write their outputs through::

    with AtomicFile(path) as f:     # f: a binary file
        f.write(...)                # an exception: nothing at ``path`` changes
"""

from __future__ import annotations

import secrets  # noqa: F401  (tests replace secrets.token_hex through this module)

from ipu_emulator.safe_files import AtomicFile, umask

__all__ = ["AtomicFile", "umask"]

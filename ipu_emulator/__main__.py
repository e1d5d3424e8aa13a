"""``python -m ipu_emulator ...`` runs one emulated IPU process (see ipu_emulator.process)."""

import sys

from ipu_emulator.process import main

sys.exit(main())

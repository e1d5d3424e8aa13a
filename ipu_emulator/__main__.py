"""``python -m ipu_emulator ...`` runs one emulated IPU process (see ipu_emulator.ipu.process)."""

import logging
import os
import sys

from ipu_emulator.ipu.process import main

code = main()
# Exit at once: main() has closed and unlinked what it must, and tearing down the
# interpreter (onnxruntime, numpy) would keep the host's close() waiting for ~50 ms.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)

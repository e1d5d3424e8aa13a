"""Build of the two C extensions.

``shm._ringcore`` (shm/_ringcore.c): the ring's hot paths, and a C API of ring
primitives for other extensions (shm/_ringcore.h, capsule ``shm._ringcore._C_API``).
``ipu_emulator.ipu._stepcore`` (ipu_emulator/ipu/_stepcore.c): a Main
iteration of the IPU process in one C call, over that C API.

Everything else is in setup.cfg. Both are optional: where they cannot be
compiled the install goes on and ``shm.Ring`` runs its pure-Python path (same
layout and protocol; see shm/ring.py), the IPU process its Python iterations.
"""

from setuptools import Extension, setup

_FLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]

setup(ext_modules=[
    Extension("shm._ringcore", ["shm/_ringcore.c"], depends=["shm/_ringcore.h"],
              libraries=["pthread"], extra_compile_args=_FLAGS, optional=True),
    Extension("ipu_emulator.ipu._stepcore", ["ipu_emulator/ipu/_stepcore.c"],
              include_dirs=["shm"], depends=["shm/_ringcore.h"], extra_compile_args=_FLAGS,
              optional=True),
])

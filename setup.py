"""Build of the one C extension, ``shm._ringcore`` (the ring's hot paths).

Everything else is in setup.cfg. The extension is optional: where it cannot
be compiled the install goes on and ``shm.Ring`` runs its pure-Python path
(same layout and protocol; see shm/ring.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("shm._ringcore", ["shm/_ringcore.c"], libraries=["pthread"],
              extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                  "-Wno-missing-field-initializers"],
              optional=True),
])

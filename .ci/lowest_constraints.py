"""Print a pip constraints file that pins every dependency setup.cfg declares to its
lowest allowed version (``name>=X`` -> ``name==X``), install and test extras alike.

CI installs the project a second time under these constraints (PIP_CONSTRAINT) and
runs the README's test command unchanged, so the lower bounds published in setup.cfg
are the ones the suite is known to pass on. Requirements without a lower bound are
left to pip.
"""

from __future__ import annotations

import configparser
import pathlib
import re
import sys

_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*?)\s*(;.*)?$")


def lowest_pins(setup_cfg: pathlib.Path) -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(setup_cfg, encoding="utf-8")
    lines = cfg.get("options", "install_requires", fallback="").splitlines()
    if cfg.has_section("options.extras_require"):
        for extra in cfg.options("options.extras_require"):
            lines += cfg.get("options.extras_require", extra).splitlines()
    pins: dict[str, str] = {}
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _REQ.match(line)
        if m is None:
            raise SystemExit(f"lowest_constraints: cannot read the requirement {raw!r} in {setup_cfg}")
        name, spec = m.group(1), m.group(3)
        for clause in filter(None, (c.strip() for c in spec.split(","))):
            if clause.startswith(">="):
                pins[name.lower()] = f"{name}=={clause[2:].strip()}"
    return sorted(pins.values(), key=str.lower)


if __name__ == "__main__":
    here = pathlib.Path(__file__).resolve().parent.parent
    print("\n".join(lowest_pins(here / "setup.cfg")))
    sys.exit(0)

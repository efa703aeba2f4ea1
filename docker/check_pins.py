"""Fail the image build if an installed distribution differs from its pin.

    python3 docker/check_pins.py docker/requirements-gpu.txt

Reads installed versions from package metadata only (importing transformer-engine or sglang
needs a GPU driver, which a ``docker build`` does not have).  A local version label (torch's
``+cu130``) is ignored.
"""

import re
import sys
from importlib.metadata import PackageNotFoundError, version


def pins(path):
    for line in open(path, encoding="utf-8"):
        line = line.split("#", 1)[0].strip()
        if line:
            m = re.fullmatch(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==([^\s;]+)", line)
            if not m:
                raise SystemExit(f"{path}: not a pin: {line!r}")
            yield m.group(1), m.group(3)


def main(path):
    bad = []
    for name, want in pins(path):
        try:
            have = version(name)
        except PackageNotFoundError:
            bad.append(f"{name}: not installed (pinned {want})")
            continue
        if have.split("+", 1)[0] != want:
            bad.append(f"{name}: installed {have}, pinned {want}")
    if bad:
        raise SystemExit("installed versions differ from " + path + ":\n  " + "\n  ".join(bad))
    print(f"all pins of {path} installed")


if __name__ == "__main__":
    main(sys.argv[1])

"""Unpack every wheel in a directory into one target directory (used inside image builds).

The base image may have no pip. A wheel is a zip file laid out as site-packages, so unpacking
it there is an install: this does exactly that, in sorted order, keeping the file modes the
wheel records (the Claude SDK's bundled CLI must stay executable), refusing paths that would
escape the target, and moving `*.data/purelib|platlib` into place. Scripts and headers in
`*.data/` are skipped: the image runs `python3 -m mdclaw_agent` and needs no entry points.

    python3 install-wheels.py WHEELHOUSE TARGET
"""

import os
import shutil
import sys
import zipfile
from pathlib import Path


def install(wheel: Path, target: Path) -> int:
    count = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            parts = Path(name).parts
            if not parts or name.endswith("/") or ".." in parts or Path(name).is_absolute():
                continue
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            dest = target.joinpath(*parts)
            dest.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, 1024 * 1024)
            mode = (info.external_attr >> 16) & 0o777
            os.chmod(dest, 0o755 if mode & 0o111 else 0o644)
            count += 1
    return count


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    wheelhouse, target = Path(sys.argv[1]), Path(sys.argv[2])
    target.mkdir(parents=True, exist_ok=True)
    wheels = sorted(wheelhouse.glob("*.whl"))
    for wheel in wheels:
        n = install(wheel, target)
        print(f"install-wheels: {wheel.name}: {n} files")
    if not wheels:
        print(f"install-wheels: no wheels in {wheelhouse}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

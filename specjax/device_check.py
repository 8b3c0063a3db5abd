"""Moved: the device check is the script ``scripts/device_check.py`` of a source checkout,
run by ``bash scripts/device_check.sh``. For one release, ``python -m
specjax.device_check ARGS`` still runs it, with the same arguments, where it finds the
script: next to the package (a source checkout) or under the current directory."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

SCRIPT = Path("scripts") / "device_check.py"


def find_script() -> Path | None:
    """``scripts/device_check.py`` beside the package's folder, else under the current
    directory; None where neither has it (an installed wheel)."""
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):
        if (root / SCRIPT).is_file():
            return root / SCRIPT
    return None


def main(argv: list[str] | None = None) -> int:
    """Runs the script as ``__main__`` with ``argv`` (default: this command's arguments)
    after one line on stderr saying the module moved: exits as the script does (its
    ``SystemExit``). Without a script: one line naming ``scripts/device_check.sh``, and 2."""
    path = find_script()
    if path is None:
        print("specjax.device_check moved out of the package: run "
              "`bash scripts/device_check.sh` from a source checkout of specjax",
              file=sys.stderr)
        return 2
    print(f"specjax.device_check moved to {path}: run it, or `bash scripts/device_check.sh`",
          file=sys.stderr)
    sys.argv = [str(path), *(sys.argv[1:] if argv is None else argv)]
    runpy.run_path(str(path), run_name="__main__")  # the script's own sys.exit ends it
    return 0


if __name__ == "__main__":
    sys.exit(main())

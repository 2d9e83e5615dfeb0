"""Runs a module (`-m celery ...`, `manage.py ...`) with .venv-agl's Python, our project's
packages filling in what AGL's environment lacks (Django, Celery, ...). AGL's own versions win
where both have a package (OpenTelemetry 1.44), as in a `pip install -e '.[agl]'` environment.

    .venv-agl/bin/python tests/agl/with_project.py -m celery -A lightning_site worker ...
    .venv-agl/bin/python tests/agl/with_project.py manage.py runner ...
"""

from __future__ import annotations

import glob
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    sys.path.insert(0, str(ROOT))
    sys.path += glob.glob(str(ROOT / ".venv" / "lib" / "python3*" / "site-packages"))
    args = sys.argv[1:]
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()

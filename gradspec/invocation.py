"""How the user runs gradspec, for the commands a summary suggests next: after set-up only
`.venv/bin/gradspec` may exist, and a `gradspec …` line would not run as printed."""

from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path


def program() -> str:
    """`gradspec` where that name on PATH is the program running; else the path it was run by
    (`.venv/bin/gradspec`), or `python -m gradspec`. From Python (no gradspec script running): `gradspec`."""
    ran = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if Path(ran).name == "__main__.py" and Path(ran).parent.name == "gradspec":
        return "python -m gradspec"
    if Path(ran).name != "gradspec":
        return "gradspec"
    found = shutil.which("gradspec")
    if found is not None and Path(found).resolve() == Path(ran).resolve():
        return "gradspec"
    return shlex.quote(ran)

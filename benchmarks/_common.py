"""Shared by the benchmark scripts: make the repository importable and write results."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_json(path: str | None, result: dict) -> None:
    """Write ``result`` whole or not at all (a temporary file renamed over ``path``): scripts rewrite their JSON
    after every row and may be stopped by a time limit at any moment."""
    if path:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)


def commit() -> str | None:
    """The commit measured: $TWOGRID_COMMIT when set (a device machine's copy of .git can be older than the tree
    sent to it), else the tree's git HEAD, else None."""
    import subprocess

    if os.environ.get("TWOGRID_COMMIT"):
        return os.environ["TWOGRID_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None

"""A one-line progress bar on stderr (capture and benchmark runs)."""

from __future__ import annotations

import sys


def progress_bar(done: int, total: int, text: str, width: int = 24) -> None:
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {text:<48}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()

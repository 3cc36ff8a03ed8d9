"""Bench outputs: the terminal table, JSON, a Markdown report and PNG plots.

Output paths are checked before the bench measures anything (``check_outputs``);
the files are rendered in memory (``tables``, ``markdown``, ``plots``) and written
as one set (``files.commit_files``).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import InputError
from .files import commit_files, creatable_dir
from .markdown import JSON_KEYS, markdown
from .plots import PLOTS, plots
from .tables import (EAGER_NOTE, HEADER, MODES, MODES_HEADER, NO_GRAPH, PEER_HEADER,
                     TP_HEADER, table)

# what callers import from here (the outputs, rendered by one module each)
__all__ = ["EAGER_NOTE", "HEADER", "JSON_KEYS", "MODES", "MODES_HEADER", "NO_GRAPH",
           "PEER_HEADER", "PLOTS", "TP_HEADER", "check_outputs", "markdown", "output_paths",
           "plots", "table", "write_outputs"]


def output_paths(out_dir: Path, json_path: Path | None) -> list[Path]:
    """Every file the bench writes: the plots, the Markdown report, then the JSON."""
    return [*(out_dir / name for name in PLOTS), out_dir / "bench.md",
            json_path or out_dir / "bench.json"]


def check_outputs(out_dir: Path, json_path: Path | None) -> None:
    """Refuse output paths that could not be written, before any measurement."""
    creatable_dir(out_dir, "output directory")
    if json_path is not None:
        label = f"JSON path {json_path}"
        if json_path.is_dir():
            raise InputError(f"{label}: is a directory, expected a file")
        if json_path.absolute() in {p.absolute() for p in output_paths(out_dir, None)[:-1]}:
            raise InputError(f"{label}: would overwrite another bench output")
        creatable_dir(json_path.parent, label)
    for path in output_paths(out_dir, json_path):
        if path.is_dir():
            raise InputError(f"bench output {path}: is a directory")


def write_outputs(report: dict, out_dir: Path, json_path: Path | None) -> None:
    """JSON, Markdown and the plots, committed as one set (``commit_files``)."""
    *plot_paths, md_path, json_path = output_paths(out_dir, json_path)
    report["outputs"] = {"plots": [str(p) for p in plot_paths], "markdown": str(md_path),
                         "json": str(json_path)}
    pngs = plots(report)
    files = {p: pngs[p.name] for p in plot_paths}
    files[md_path] = markdown(report).encode()
    files[json_path] = json.dumps(report, indent=2, default=str).encode()
    commit_files(files)

"""The README is a front door that cannot go stale: at most 12 KB, its layout table
names every package and module of the tree (and nothing else), and every relative
link of the README and of docs/*.md points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_BYTES = 12 * 1024


def layout_rows(text: str) -> dict[str, set[str]]:
    """The layout table -> {package dir: module names}; `nextn_graph/` is the top level."""
    section = text.split("\n## Layout", 1)[1]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`nextn_graph"):
            continue
        package = cells[0].strip("`")
        assert package not in rows, f"{package} listed twice"
        rows[package] = set(re.findall(r"`([a-z_0-9]+)`", cells[1]))
    return rows


def tree_modules() -> dict[str, set[str]]:
    pkg = ROOT / "nextn_graph"
    tree = {}
    for d in sorted(init.parent for init in pkg.rglob("__init__.py")):  # subpackages too
        name = "nextn_graph/" if d == pkg else f"nextn_graph/{d.relative_to(pkg).as_posix()}/"
        tree[name] = {f.stem for f in d.glob("*.py") if f.stem not in ("__init__", "__main__")}
    return tree


def test_readme_is_at_most_12_kb():
    assert len(README.read_bytes()) <= MAX_BYTES, len(README.read_bytes())


def test_layout_table_matches_the_tree():
    rows, tree = layout_rows(README.read_text()), tree_modules()
    assert sorted(rows) == sorted(tree), "packages listed vs packages in the tree"
    for package, modules in tree.items():
        assert rows[package] == modules, (package, "missing:", sorted(modules - rows[package]),
                                          "not in the tree:", sorted(rows[package] - modules))


def test_layout_parser_sees_a_stale_row():
    """The check has teeth: a module left out, or one that does not exist, is caught."""
    text = README.read_text()
    stale = text.replace("`engine`", "`engine_old`", 1)
    assert layout_rows(stale)["nextn_graph/runtime/"] != tree_modules()["nextn_graph/runtime/"]


def test_relative_links_resolve():
    docs = [README] + sorted((ROOT / "docs").glob("*.md"))
    broken = []
    for doc in docs:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert broken == []

"""The tree itself: what a merge can leave behind unnoticed by the linters."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Text the project writes (the linters already parse .py, but not docs, pages or scripts).
TEXT_SUFFIXES = {".py", ".md", ".js", ".html", ".css", ".toml", ".sh", ".cfg", ".txt", ".json"}
SKIPPED_DIRS = {".git", ".venv", "models", "node_modules", "__pycache__", ".mypy_cache"}
CONFLICT_MARKER = re.compile(r"^(<{7} |>{7} |={7}$)", re.MULTILINE)


def project_text_files() -> list[Path]:
    files = []
    for folder, dirs, names in os.walk(ROOT):
        # Pruned in place: .venv alone holds tens of thousands of files.
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and (d == ".ci" or d[0] != ".")]
        here = Path(folder)
        for name in names:
            path = here / name
            if path.suffix in TEXT_SUFFIXES or here.name == ".ci":
                files.append(path)
    return files


def test_no_file_holds_merge_conflict_markers() -> None:
    """An unresolved conflict committed in README.md broke its configuration table (and
    hid one side's row): no linter reads Markdown, so this test does."""
    files = project_text_files()
    assert any(p.name == "README.md" for p in files)  # the walk does reach the docs
    marked = [
        f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}"
        for path in files
        for text in [path.read_text(errors="replace")]
        for m in CONFLICT_MARKER.finditer(text)
    ]
    assert marked == []

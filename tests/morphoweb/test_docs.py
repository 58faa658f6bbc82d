"""The README and the pages under docs/: every relative link reaches a file, and its anchor a heading."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md",
         *sorted((REPO / "docs" / "benchmarks").glob("*.md"))]
LINK = re.compile(r"\[(?:[^\]`]|`[^`]*`)*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The ids GitHub gives the page's headings: link syntax and punctuation dropped, spaces to dashes."""
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", line.lstrip("#").strip())
        found.add(re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-"))
    return found


def test_the_slugs_are_githubs():
    assert anchors(REPO / "docs" / "CLIENT.md") >= {"http-api-protocolmd-section-5",
                                                    "bulk-jobs-bulkjobs-authenticated"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_reaches_its_file_and_heading(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(target)
    assert broken == []


def test_the_readme_stays_short_and_points_to_every_topic_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for name in ("CLIENT", "OPERATIONS", "DEPLOYMENT", "PERFORMANCE", "DEVELOPMENT"):
        assert f"](docs/{name}.md)" in readme, name
    assert "make run" in readme and "make test" in readme


def test_the_docs_site_builds_strict(tmp_path):
    # mkdocs.yml's strict build fails on a page missing from the nav, a link to no page, an anchor
    # no heading has; the material theme comes with the test extras
    pytest.importorskip("material")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "PERFORMANCE" / "index.html").exists()

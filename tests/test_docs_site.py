"""The documentation site builds without a broken link, and the docs stay a reference."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]


def test_mkdocs_build_strict(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "configuration" / "index.html").is_file()


def test_every_page_is_in_the_nav():
    nav = (REPO / "mkdocs.yml").read_text()
    for page in (REPO / "docs").glob("*.md"):
        assert f": {page.name}" in nav, page.name


def test_no_narration_of_sessions_in_the_docs():
    for page in PAGES:
        assert "session" not in page.read_text().lower(), page.name


def test_readme_is_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 200

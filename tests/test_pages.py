"""Each study's page in results/ is what its JSON says: `python -m experiments.pages` writes it anew from
the committed JSON (experiments.pages), and the committed page must be exactly that."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from experiments.pages import ROOT, WRITERS, pages, studied, write_pages

FOLDERS = studied(sorted(ROOT.glob("results/*/")) + sorted(ROOT.glob("results/*/*/")))


def test_every_study_with_results_has_its_page_written_from_json() -> None:
    names = {path.stem for folder in FOLDERS for path in folder.glob("*.json") if path.stem in WRITERS}
    assert {"study", "curve", "leakage", "screen"} <= names


@pytest.mark.parametrize("folder", FOLDERS, ids=[str(folder.relative_to(ROOT)) for folder in FOLDERS])
def test_a_committed_page_is_what_its_json_writes(folder: Path) -> None:
    for page, text in pages(folder, pictures=False).items():
        assert page.read_text() == text, f"{page} differs: python -m experiments.pages {folder.relative_to(ROOT)}"


def test_the_command_writes_the_pages_and_pictures(tmp_path: Path) -> None:
    copy = tmp_path / "study"
    shutil.copytree(ROOT / "results" / "study", copy, ignore=shutil.ignore_patterns("*.png", "*.md"))
    assert write_pages(copy) == [copy / "study.md"]
    assert (copy / "study.md").read_text() == (ROOT / "results" / "study" / "study.md").read_text()
    assert {path.name for path in copy.glob("*.png")} == {"accuracy.png", "curves.png"}

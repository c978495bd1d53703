"""Each study's page in results/, written anew from the study's JSON beside it: the tables (`<name>.md`)
and, where the study has them, its pictures. The study's own command writes them as it finishes; this
writes them again from what was committed, so that a page is always what its numbers say.

    python -m experiments.pages                                  # every results/*/ folder that has a study's JSON
    python -m experiments.pages results/curve results/study      # these
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def study_page(record: dict[str, Any], folder: Path | None) -> str:
    from experiments.report import plot_accuracy, plot_curves, render

    if folder is not None:
        plot_accuracy(record, folder / "accuracy.png")
        plot_curves(record, folder / "curves.png")
    return render(record, record["command"])


def curve_page(record: dict[str, Any], folder: Path | None) -> str:
    from experiments.curve_page import plot, render

    if folder is not None:
        plot(record, folder / "curve.png")
    return render(record, record["command"])


def leakage_page(record: dict[str, Any], folder: Path | None) -> str:
    from experiments.leakage import render

    return render(record)


def levers_page(record: dict[str, Any], folder: Path | None) -> str:
    from experiments.levers import render

    return render(record, record["command"])


def screen_page(record: dict[str, Any], folder: Path | None) -> str:
    from experiments.screen_page import render

    return render(record)


# A study's JSON -> its page, and what writes its pictures into a folder (None: no pictures).
WRITERS: dict[str, Callable[[dict[str, Any], Path | None], str]] = {
    "study": study_page,
    "curve": curve_page,
    "leakage": leakage_page,
    "levers": levers_page,
    "screen": screen_page,
}


def pages(folder: Path, *, pictures: bool = True) -> dict[Path, str]:
    """{page: its text} of every study's JSON in `folder`, and with `pictures` their pictures written there."""
    found = {}
    for name, writer in WRITERS.items():
        source = folder / f"{name}.json"
        if source.is_file():
            found[folder / f"{name}.md"] = writer(json.loads(source.read_text()), folder if pictures else None) + "\n"
    return found


def write_pages(folder: Path) -> list[Path]:
    """Write the page (and pictures) of every study's JSON in `folder`; returns the pages written."""
    written = pages(folder)
    for page, text in written.items():
        page.write_text(text)
    return list(written)


def studied(folders: list[Path]) -> list[Path]:
    """The folders that hold a study's JSON."""
    return [folder for folder in folders if any((folder / f"{name}.json").is_file() for name in WRITERS)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="*", help="results folders (default: every results/*/ with a study's JSON)")
    args = parser.parse_args(argv)
    folders = [Path(f) for f in args.folders] or studied(
        sorted(ROOT.glob("results/*/")) + sorted(ROOT.glob("results/*/*/"))
    )
    for folder in folders:
        for page in write_pages(folder):
            print(f"pages: {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

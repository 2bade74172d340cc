"""Committed notebooks are executed, clean and in course order (nbval re-runs them separately)."""

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_lessons():
    assert NOTEBOOKS, "notebooks/ holds no lessons"


def test_names_are_numbered_in_order():
    """Lessons are named NN_topic.ipynb with NN = 01, 02, ... and no gaps."""
    numbers = [int(re.match(r"(\d\d)_[a-z0-9_]+\.ipynb$", nb.name).group(1)) for nb in NOTEBOOKS]
    assert numbers == list(range(1, len(NOTEBOOKS) + 1))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_with_outputs_and_no_errors(path):
    """Every code cell was executed in order, in one run, and no cell shows an error."""
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    counts = [c["execution_count"] for c in code]
    assert counts == list(range(1, len(code) + 1)), f"{path.name}: run `make execute` (counts {counts})"
    for cell in code:
        assert all(o.get("output_type") != "error" for o in cell["outputs"]), path.name
        for o in cell["outputs"]:
            if o.get("output_type") == "stream" and o.get("name") == "stderr":
                assert "Traceback" not in "".join(o["text"]), path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_opens_with_goals_and_setup(path):
    """A lesson starts with markdown (goals, time) and, after the Colab setup cell, its first code cell
    sets seed and device."""
    nb = json.loads(path.read_text())
    assert nb["cells"][0]["cell_type"] == "markdown"
    first_code = next(c for c in nb["cells"] if c["cell_type"] == "code"
                      and "colab-setup" not in c["metadata"].get("tags", []))
    src = "".join(first_code["source"])
    assert "manual_seed" in src and "kvlessons.device()" in src


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_ends_with_its_references_as_links(path):
    """Every lesson ends with a References section whose entries are links."""
    nb = json.loads(path.read_text())
    last = "".join(nb["cells"][-1]["source"])
    assert last.startswith("## References"), path.name
    entries = [line for line in last.splitlines() if line.startswith("- ")]
    assert entries and all(re.search(r"\]\(https://[^)]+\)", line) for line in entries), path.name

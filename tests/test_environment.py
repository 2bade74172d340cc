"""The two ways to build the environment must agree, and make must pin torch."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _requirements():
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")}


def _conda_pip_section():
    text = (ROOT / "environment.yml").read_text()
    section = text.split("- pip:", 1)[1]
    return {m.group(1).strip() for m in re.finditer(r"^\s+-\s+(\S.*)$", section, re.M)}


def test_environment_yml_pins_equal_requirements():
    """environment.yml's pip section holds exactly requirements.txt's pins, plus the package itself."""
    assert _conda_pip_section() == _requirements() | {"-e ."}


def test_every_requirement_is_pinned_exactly():
    """Every requirement is name==version; torch is pinned (an unpinned torch pulls a multi-GB CUDA build)."""
    reqs = _requirements()
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][0-9A-Za-z.]*", r) for r in reqs), reqs
    assert "torch==2.13.0" in reqs

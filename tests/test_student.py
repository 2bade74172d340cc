"""Student copies: solutions stubbed, and when executed the only errors are the stubs' NotImplementedErrors."""

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from kvlessons.course.student import stub_source, student_notebook, write_student_copies

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
WITH_EXERCISES = [p for p in sorted(NOTEBOOKS.glob("*.ipynb")) if '"solution"' in p.read_text()]


def test_stub_keeps_names_and_signatures():
    src = "def f(a, b=2):\n    return a + b\n\nx = 3\ny, z = 1, 2\n"
    stub = stub_source(src)
    assert "def f(a, b=2):" in stub and "return a + b" not in stub
    assert "x = None" in stub and "y = None" in stub and "z = None" in stub
    assert stub.rstrip().splitlines()[-1].startswith("raise NotImplementedError")
    ns = {}
    with pytest.raises(NotImplementedError):
        exec(stub, ns)
    with pytest.raises(NotImplementedError, match="Exercise"):
        ns["f"](1)


def test_every_solution_cell_is_stubbed_and_outputs_cleared():
    for path in WITH_EXERCISES:
        nb = json.loads(path.read_text())
        student, count = student_notebook(nb)
        solutions = [c for c in nb["cells"] if "solution" in c.get("metadata", {}).get("tags", [])]
        assert count == len(solutions) > 0
        for cell in student["cells"]:
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None
        stubbed = [c for c in student["cells"] if "solution" in c.get("metadata", {}).get("tags", [])]
        assert all("NotImplementedError" in c["source"] for c in stubbed)


@pytest.mark.parametrize("path", WITH_EXERCISES, ids=lambda p: p.name)
def test_student_copy_runs_with_only_stub_errors(path, tmp_path):
    """Executed top to bottom, a student copy fails only in stub cells, only with NotImplementedError."""
    write_student_copies(NOTEBOOKS, tmp_path)
    nb = nbformat.read(tmp_path / path.name, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    errors, shown = [], []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                errors.append((out["ename"], "solution" in cell.metadata.get("tags", [])))
            shown.append(json.dumps(out))
    assert all(name == "NotImplementedError" and in_stub for name, in_stub in errors), errors
    # A value stub raises in its own cell; a function stub raises when the checker calls it, and the
    # checker reports that. Either way the learner sees NotImplementedError once per exercise at least.
    stubs = sum("solution" in c.metadata.get("tags", []) for c in nb.cells)
    assert sum(s.count("NotImplementedError") for s in shown) >= stubs


def test_existing_copies_are_kept_unless_overwritten(tmp_path):
    """Regenerating student copies never erases a learner's work; --overwrite starts over."""
    first = write_student_copies(NOTEBOOKS, tmp_path)
    assert all(isinstance(n, int) for n in first.values()) and set(first) == {p.name for p in NOTEBOOKS.glob("*.ipynb")}
    for name in first:  # the solved lessons sit beside the copies, unchanged
        assert (tmp_path / "solutions" / name).read_text() == (NOTEBOOKS / name).read_text()
    lesson = tmp_path / WITH_EXERCISES[0].name
    lesson.write_text(lesson.read_text().replace("NotImplementedError", "my answer", 1))
    again = write_student_copies(NOTEBOOKS, tmp_path)
    assert set(again.values()) == {None} and "my answer" in lesson.read_text()
    write_student_copies(NOTEBOOKS, tmp_path, overwrite=True)
    assert "my answer" not in lesson.read_text()


def test_a_class_solution_keeps_its_methods_as_stubs():
    """A solution written as a class keeps the class, its bases and every method's signature; each method raises."""
    src = "class MyCache(object):\n    def __init__(self):\n        self.k = None\n\n    def update(self, k, v):\n        return k, v\n"
    stub = stub_source(src)
    assert "class MyCache(object):" in stub and "def update(self, k, v):" in stub and "return k, v" not in stub
    ns = {}
    exec(stub, ns)
    with pytest.raises(NotImplementedError, match="Exercise"):
        ns["MyCache"]()

"""Student copies of the lessons: every exercise solution replaced by a stub.

Solutions live in code cells tagged ``solution`` in the committed notebooks (one
source). ``python -m kvlessons.course.student [out_dir]`` (``make student``; ``make lab`` runs it
and opens the copies) writes copies in which each such cell becomes a stub: functions keep their signature and raise
NotImplementedError with a hint; assigned names are set to None and the cell raises
NotImplementedError, so the checker cell after it still runs and says what is missing.
"""

from __future__ import annotations

import argparse
import ast
import json
import shutil
from pathlib import Path

SOLUTION_TAG = "solution"
SOLUTIONS = "solutions"  # the folder, inside the student copies, holding the solved lessons
HINT = "Exercise: replace this stub with your solution; the checker in the next cell tells you what is wrong."


def stub_source(solution: str, hint: str = HINT) -> str:
    """The stub that replaces one solution cell's source."""
    tree = ast.parse(solution)
    lines = ["# Your turn: write the solution here (the checker below tells you what is wrong)."]
    assigned = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            lines += [f"def {node.name}({ast.unparse(node.args)}):", f"    raise NotImplementedError({hint!r})", ""]
        elif isinstance(node, ast.ClassDef):  # the class and its methods' signatures stay; every method body is the stub
            bases = ", ".join(ast.unparse(b) for b in node.bases)
            lines.append(f"class {node.name}({bases}):" if bases else f"class {node.name}:")
            methods = [m for m in node.body if isinstance(m, ast.FunctionDef)]
            for m in methods:
                lines += [f"    def {m.name}({ast.unparse(m.args)}):", f"        raise NotImplementedError({hint!r})", ""]
            if not methods:
                lines += ["    pass", ""]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name) and name.id not in assigned:
                        assigned.append(name.id)
    lines += [f"{name} = None" for name in assigned]
    if assigned:
        lines.append(f"raise NotImplementedError({hint!r})")
    return "\n".join(lines).rstrip() + "\n"


def student_notebook(nb: dict) -> tuple[dict, int]:
    """A copy of notebook JSON ``nb`` with solution cells stubbed and every output cleared; and the count."""
    out = json.loads(json.dumps(nb))
    count = 0
    for cell in out["cells"]:
        if cell["cell_type"] != "code":
            continue
        cell["outputs"], cell["execution_count"] = [], None
        if SOLUTION_TAG in cell.get("metadata", {}).get("tags", []):
            src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            cell["source"] = stub_source(src)
            count += 1
    return out, count


def write_student_copies(notebooks_dir: str | Path = "notebooks", out_dir: str | Path = "student",
                         overwrite: bool = False) -> dict[str, int | None]:
    """Write a student copy of every lesson into ``out_dir``; return {notebook name: stubs written}.

    A copy that already exists is kept (None in the result): it may hold a learner's work,
    which regenerating would erase. ``overwrite=True`` starts every copy over. The solved
    lessons are copied beside them into ``out_dir/solutions/``, refreshed every time.
    """
    src, dst = Path(notebooks_dir), Path(out_dir)
    (dst / SOLUTIONS).mkdir(parents=True, exist_ok=True)
    written: dict[str, int | None] = {}
    for path in sorted(src.glob("*.ipynb")):
        shutil.copyfile(path, dst / SOLUTIONS / path.name)  # the solved lesson, one click away (ours: always refreshed)
        target = dst / path.name
        if target.exists() and not overwrite:
            written[path.name] = None
            continue
        nb, count = student_notebook(json.loads(path.read_text()))
        target.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        written[path.name] = count
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Write student copies of the lessons (solutions replaced by stubs).")
    parser.add_argument("out_dir", nargs="?", default="student")
    parser.add_argument("--notebooks", default="notebooks")
    parser.add_argument("--overwrite", action="store_true", help="start every copy over, erasing work done in them")
    args = parser.parse_args(argv)
    for name, count in write_student_copies(args.notebooks, args.out_dir, args.overwrite).items():
        if count is None:
            print(f"{args.out_dir}/{name}: kept, it may hold your work (--overwrite to start it over)")
        else:
            print(f"{args.out_dir}/{name}: {count} exercise{'s' if count != 1 else ''} stubbed")


if __name__ == "__main__":
    main()

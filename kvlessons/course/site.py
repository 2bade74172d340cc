"""A static, readable site of the executed lessons: ``python -m kvlessons.course.site [out_dir]`` (``make site``).

Each lesson becomes one HTML page (nbconvert's lab template: figures embedded as
images, saved widget state included so widgets render where the page can load the
widget library), with a navigation bar (index, previous, next), plus an index page
listing the lessons in order with their opening paragraph.
"""

from __future__ import annotations

import argparse
import html
import json
import re
from pathlib import Path

_NAV_STYLE = ("position:sticky;top:0;z-index:10;background:#f7f7f7;border-bottom:1px solid #ddd;"
              "padding:8px 16px;font-family:sans-serif;font-size:14px")


def lesson_title(nb: dict, fallback: str) -> tuple[str, str]:
    """The first markdown heading of a notebook, and the paragraph after it."""
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            text = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            lines = [line for line in text.splitlines()]
            title = next((line.lstrip("# ").strip() for line in lines if line.startswith("#")), fallback)
            body = [line for line in lines if line.strip() and not line.startswith("#")]
            return title, (body[0] if body else "")
    return fallback, ""


def _summary(paragraph: str, limit: int = 240) -> str:
    """The paragraph's first sentences up to ``limit`` characters, with inline TeX made plain."""
    plain = paragraph.replace("\\times", "x").replace("$", "").replace("**", "")
    if len(plain) <= limit:
        return plain
    cut = plain.rfind(". ", 0, limit)
    return plain[: cut + 1] if cut > 0 else plain[:limit].rsplit(" ", 1)[0] + " ..."


def _nav(pages: list[tuple[str, str]], i: int | None) -> str:
    links = ['<a href="index.html">All lessons</a>']
    if i is not None and i > 0:
        links.append(f'<a href="{pages[i - 1][0]}">&larr; {html.escape(pages[i - 1][1])}</a>')
    if i is not None and i + 1 < len(pages):
        links.append(f'<a href="{pages[i + 1][0]}">{html.escape(pages[i + 1][1])} &rarr;</a>')
    return f'<nav class="kvlessons-nav" style="{_NAV_STYLE}">' + " &nbsp;|&nbsp; ".join(links) + "</nav>"


def build_site(notebooks_dir: str | Path = "notebooks", out_dir: str | Path = "_site") -> list[Path]:
    """Write one page per lesson and an index into ``out_dir``; return the pages written."""
    from nbconvert import HTMLExporter

    src, dst = Path(notebooks_dir), Path(out_dir)
    dst.mkdir(parents=True, exist_ok=True)
    paths = sorted(src.glob("*.ipynb"))
    if not paths:
        raise ValueError(f"no notebooks in {src}")
    notebooks = [json.loads(p.read_text()) for p in paths]
    pages = [(p.with_suffix(".html").name, lesson_title(nb, p.stem)[0]) for p, nb in zip(paths, notebooks)]
    exporter = HTMLExporter(template_name="lab")
    written = []
    for i, (path, nb) in enumerate(zip(paths, notebooks)):
        body, _ = exporter.from_filename(str(path))
        body = re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + _nav(pages, i), body, count=1)
        body = body.replace("</body>", _nav(pages, i) + "</body>", 1)
        out = dst / pages[i][0]
        out.write_text(body)
        written.append(out)
    items = "".join(
        f'<li><a href="{name}">{html.escape(title)}</a><br><span style="color:#555">'
        f"{html.escape(_summary(lesson_title(nb, '')[1]))}</span></li>"
        for (name, title), nb in zip(pages, notebooks)
    )
    index = (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvlessons: the KV cache, hands on</title></head>"
        "<body style='font-family:sans-serif;max-width:900px;margin:40px auto;line-height:1.5'>"
        "<h1>kvlessons: the transformer KV cache, hands on</h1>"
        "<p>The executed lessons, readable without a kernel. To run and change them, clone the repository and "
        "type <code>make lab</code>.</p>"
        f"<ol style='padding-left:1.2em'>{items}</ol></body></html>"
    )
    (dst / "index.html").write_text(index)
    return [dst / "index.html", *written]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Build a static HTML site of the executed lessons.")
    parser.add_argument("out_dir", nargs="?", default="_site")
    parser.add_argument("--notebooks", default="notebooks")
    args = parser.parse_args(argv)
    for page in build_site(args.notebooks, args.out_dir):
        print(page)


if __name__ == "__main__":
    main()

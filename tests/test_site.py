"""The static site: an index in course order and one page per lesson with navigation and embedded figures."""

import re
from pathlib import Path

from kvlessons.course.site import build_site

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def test_site_pages_and_navigation(tmp_path):
    pages = build_site(NOTEBOOKS, tmp_path)
    lessons = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert [p.name for p in pages] == ["index.html"] + [p.with_suffix(".html").name for p in lessons]
    index = (tmp_path / "index.html").read_text()
    assert re.findall(r'href="([^"]+)"', index) == [p.with_suffix(".html").name for p in lessons]
    first, second, last = (tmp_path / lessons[i].with_suffix(".html").name for i in (0, 1, -1))
    assert 'href="index.html"' in first.read_text() and f'href="{second.name}"' in first.read_text()
    assert f'href="{first.name}"' in second.read_text()
    assert "&rarr;" not in last.read_text().split("</nav>")[0]  # no next page after the capstone
    assert "data:image/png;base64" in first.read_text()  # figures are embedded, the page stands alone
    assert "application/vnd.jupyter.widget-state+json" in first.read_text()  # saved widget state travels along

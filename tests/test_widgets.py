import pytest

from conftest import random_ids, small_model
from kvlessons.cache import ConcatCache
from kvlessons.generate import trace_generation
from kvlessons.model import CharTokenizer
from kvlessons.widgets import cache_growth_widget, cache_step_html, describe_cache_step


@pytest.fixture
def trace():
    model = small_model(vocab_size=96)
    return trace_generation(model, random_ids(1, 4, vocab=96), 3, ConcatCache())


def test_cache_step_html_shows_one_kv_column_per_cached_token(trace):
    """At step s the view shows (prompt + s) K and V cells for each layer and the cache size."""
    tok = CharTokenizer()
    for step in range(3):
        page = cache_step_html(trace, step, tok, layers=2, prompt_len=4)
        assert page.count('data-kind="K"') == 2 * (4 + step)
        assert page.count('data-kind="V"') == 2 * (4 + step)
        assert f"{trace[step].cache_bytes:,} bytes" in page
    assert "after prefill" in cache_step_html(trace, 0, tok, 2, 4)


def test_cache_step_html_rejects_bad_step(trace):
    with pytest.raises(ValueError, match="step"):
        cache_step_html(trace, 3, CharTokenizer(), 2, 4)


def test_describe_cache_step(trace):
    assert describe_cache_step(trace, 1) == f"step 1: 5 tokens cached, {trace[1].cache_bytes:,} bytes"


def test_widget_builds_and_follows_the_slider(trace):
    """The widget has a play button linked to a slider spanning every step."""
    box = cache_growth_widget(trace, CharTokenizer(), layers=2, prompt_len=4)
    play, slider = box.children[0].children
    assert (slider.min, slider.max) == (0, 2) and (play.min, play.max) == (0, 2)
    slider.value = 2  # triggers a redraw; must not raise

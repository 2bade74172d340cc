import itertools

import pytest

from conftest import random_ids, small_model
from kvlessons.cache import ConcatCache
from kvlessons.generate import trace_generation
from kvlessons.memory import DTYPES, PRESETS, estimate, format_bytes, kv_bytes_per_token, kv_cache_bytes
from kvlessons.model import CharTokenizer
from kvlessons.widgets import (
    ESTIMATOR_RANGES,
    cache_growth_widget,
    cache_step_html,
    describe_cache_step,
    estimate_html,
    head_groups_html,
    head_groups_widget,
    memory_estimator_widget,
)


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


def test_cache_widget_view_follows_the_slider(trace):
    """Moving the step slider rewrites the view for that step."""
    box = cache_growth_widget(trace, CharTokenizer(), layers=2, prompt_len=4)
    assert "<b>Step 0</b>" in box.view.value
    box.slider.value = 2
    assert "<b>Step 2</b>" in box.view.value and "6 tokens cached" in box.view.value


# --- memory estimator -------------------------------------------------------------------------

def test_estimator_defaults_show_the_seed_example():
    """Defaults: 32 layers, 8 KV heads, 128 head dim, 4,096 tokens, 8 sequences, bf16 = 4 GiB; 4 KiB, 128 KiB, 512 MiB."""
    box = memory_estimator_widget()
    page = box.view.value
    for text in ("<b>4 GiB</b>", "<b>4 KiB</b>", "<b>128 KiB</b>", "<b>512 MiB</b>", "2 · 32 layers · 8 KV heads · 128 head dim"):
        assert text in page


def test_estimator_updates_when_a_slider_moves():
    """Doubling the context doubles the displayed total to the value kvlessons.memory computes."""
    box = memory_estimator_widget()
    box.sliders["seq_len"].value = 8192
    assert "<b>8 GiB</b>" in box.view.value
    box.dtype.value = "nvfp4"
    assert f"<b>{format_bytes(estimate(32, 8, 128, 8192, 8, 'nvfp4').total)}</b>" in box.view.value


def test_estimator_preset_and_its_exact_figure():
    """A preset loads its shape; where windows make the uniform formula wrong, the exact figure is shown."""
    box = memory_estimator_widget()
    box.presets.value = "Gemma-2-9B"
    assert (box.sliders["layers"].value, box.sliders["kv_heads"].value, box.sliders["head_dim"].value) == (42, 8, 256)
    box.sliders["seq_len"].value = 16384
    assert "Gemma-2-9B exactly" in box.view.value
    box.sliders["layers"].value = 40  # moving a shape slider leaves the preset
    assert box.presets.value == "custom" and "exactly" not in box.view.value


@pytest.mark.parametrize("name", ["DeepSeek-V2-Lite", "DeepSeek-V2", "DeepSeek-V3"])
def test_estimator_shows_deepseek_as_mla_latents(name):
    """A DeepSeek model loads as what it caches (one 576-wide latent per layer per token), not as clamped K/V heads."""
    p = PRESETS[name]
    box = memory_estimator_widget()
    box.presets.value = name
    box.sliders["seq_len"].value = 8192
    page = box.view.value
    assert f"<b>{format_bytes(kv_cache_bytes(p.shape, 8192, 8, 'bf16'))}</b>" in page  # 4.29 GiB: MLA's figure
    assert f"<b>{format_bytes(kv_bytes_per_token(p.shape))}</b>" in page and "576 latent values" in page
    assert "KV head" not in page.split("<table")[0] and "64 KV heads" not in page and f"{p.shape.kv_heads} KV heads" not in page
    assert box.sliders["kv_heads"].disabled and box.sliders["head_dim"].disabled
    box.dtype.value = "nvfp4"  # the latent in 4.5 bits
    assert f"<b>{format_bytes(kv_cache_bytes(p.shape, 8192, 8, 'nvfp4'))}</b>" in box.view.value
    box.sliders["layers"].value = 40  # leaves the preset: the K/V sliders count again
    assert box.presets.value == "custom" and not box.sliders["kv_heads"].disabled
    assert "576 latent" not in box.view.value


def test_every_preset_fits_the_sliders():
    """A preset's layers (and K/V heads, head dim unless it caches latents) lie on the sliders: nothing is clamped."""
    from kvlessons.widgets import _preset_slider_values

    for name in PRESETS:
        for key, v in _preset_slider_values(name).items():
            lo, hi, step = ESTIMATOR_RANGES[key]
            assert lo <= v <= hi and (v - lo) % step == 0, (name, key, v)
    assert _preset_slider_values("DeepSeek-V3") == {"layers": 61}


def test_context_slider_reaches_the_128k_of_the_table():
    """The context slider goes to 131,072 tokens, the longest length the presets' table discusses."""
    assert ESTIMATOR_RANGES["seq_len"][1] >= 131072
    box = memory_estimator_widget()
    box.sliders["seq_len"].value = 131072
    assert box.sliders["seq_len"].value == 131072
    assert "131,072 tokens" in box.view.value
    assert f"<b>{format_bytes(estimate(32, 8, 128, 131072, 8).total)}</b>" in box.view.value  # 128 GiB


def test_estimator_counts_in_words_that_agree_with_the_number():
    """One KV head and one sequence are singular; more are plural."""
    one = estimate_html(estimate(8, 1, 32, 512, 1, "bf16"))
    assert "1 KV head ·" in one and "for 1 sequence of" in one
    assert "1 KV heads" not in one and "1 sequences" not in one
    two = estimate_html(estimate(8, 2, 32, 512, 2, "bf16"))
    assert "2 KV heads ·" in two and "for 2 sequences of" in two


def test_estimator_cannot_be_driven_into_an_exception():
    """Every extreme slider position, with every precision and preset, renders."""
    for layers, heads, dim, ctx, batch in itertools.product(*[(lo, hi) for lo, hi, _ in ESTIMATOR_RANGES.values()]):
        for dtype in DTYPES:
            for name in [None, *PRESETS]:
                estimate_html(estimate(layers, heads, dim, ctx, batch, dtype), name)
    box = memory_estimator_widget()
    for name in PRESETS:
        box.presets.value = name
        for key, (lo, hi, step) in ESTIMATOR_RANGES.items():
            for v in (lo, hi, lo + step):
                box.sliders[key].value = v
        assert "Estimated KV cache" in box.view.value


# --- head groups (lesson 03) -------------------------------------------------------------------


def test_head_groups_html_colours_each_group():
    page = head_groups_html(8, 2)
    assert page.count("data-q=") == 8 and page.count("data-kv=") == 2 and "<b>GQA</b>" in page
    assert "<b>MQA</b>" in head_groups_html(4, 1) and "<b>MHA</b>" in head_groups_html(4, 4)


def test_head_groups_widget_only_offers_divisors():
    """Changing q_heads re-offers only divisors and keeps a valid choice: the widget cannot raise."""
    box = head_groups_widget(8, 2)
    for q in range(1, 33):
        box.q_heads.value = q
        assert all(q % d == 0 for d in box.kv_heads.options)
        assert q % box.kv_heads.value == 0
        assert f"{q} query heads" in box.view.value
    box.q_heads.value = 12
    box.kv_heads.value = 3
    assert "3 KV heads" in box.view.value


# --- block tables (lesson 06) ------------------------------------------------------------------


def test_block_table_html_marks_owners_and_sharing():
    from kvlessons.paging import block_scenario
    from kvlessons.widgets import block_table_html, block_table_widget

    snaps = block_scenario(num_blocks=12, block_size=4)
    fork = next(s for s in snaps if "forked" in s["event"])
    page = block_table_html(fork)
    assert page.count("data-block=") == 12
    assert 'data-owners="A+C"' in page and "(x2)" in page
    box = block_table_widget(snaps)
    box.slider.value = len(snaps) - 1
    assert "A finishes" in box.view.value


def test_mask_explorer_keeps_q_len_valid_and_compares():
    from kvlessons.widgets import mask_explorer_html, mask_explorer_widget

    page = mask_explorer_html(1, 5)
    assert page.count("data-on='1'") == 1 + 5  # top-left sees key 0; bottom-right sees all 5
    assert "hides 4 key(s)" in page
    box = mask_explorer_widget(3, 8)
    box.kv_len.value = 2
    assert box.q_len.value <= 2 and "identical" in box.view.value
    box.kv_len.value = 16
    box.q_len.value = 4
    assert "4 new queries over 16 keys" in box.view.value

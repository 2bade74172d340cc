import pytest
import torch

from conftest import random_ids, small_model
from kvlessons.attention import padded_causal_mask, positions_from_padding
from kvlessons.cache import ConcatCache, StaticCache
from kvlessons.generate import generate
from kvlessons.pitfalls import (
    BrokenAdvancePerLayer,
    BrokenNoTransaction,
    BrokenPositionsOffByOne,
    BrokenPositionsRestart,
    BrokenRopeAfterCache,
    append_cost,
    attend_fixed,
    attend_is_causal_always,
    attend_textbook,
    broken_variant,
    expected_bytes_written,
    check_cache_consistency,
    decode_cost,
    edit_and_continue,
    first_token_divergence,
    interrupted_pass,
    left_pad,
    padded_batch_agreement,
    with_attention,
)

BROKEN_CLASSES = [BrokenPositionsRestart, BrokenPositionsOffByOne, BrokenAdvancePerLayer, BrokenRopeAfterCache]


def test_detector_passes_the_real_model(make_cache):
    """The correct model passes the consistency check with every cache variant and chunking."""
    model = small_model()
    ids = random_ids(2, 20)
    for chunks in (None, [20], [1] * 20, [7, 1, 12]):
        report = check_cache_consistency(model, ids, chunks, cache=make_cache(20))
        assert report.ok, report
    assert "OK" in str(report)


@pytest.mark.parametrize("attend_fn", [attend_is_causal_always, attend_textbook], ids=lambda f: f.__name__)
def test_detector_catches_broken_masks(attend_fn):
    """Both broken masks are caught on a multi-token append, right where the cache starts."""
    model = small_model()
    report = check_cache_consistency(with_attention(model, attend_fn), random_ids(2, 20), reference=model)
    assert not report.ok and report.first_bad_position == 10
    assert "MISMATCH" in str(report)
    assert check_cache_consistency(with_attention(model, attend_fixed), random_ids(2, 20), reference=model).ok


def test_textbook_mask_hides_in_one_token_decode():
    """is_causal=(cache is None) is right for prefill + one-token decode; only a multi-token append exposes it."""
    model = small_model()
    broken = with_attention(model, attend_textbook)
    ids = random_ids(1, 16)
    assert check_cache_consistency(broken, ids, chunks=[8] + [1] * 8, reference=model).ok
    assert not check_cache_consistency(broken, ids, chunks=[8, 4, 1, 1, 1, 1], reference=model).ok
    assert not check_cache_consistency(with_attention(model, attend_is_causal_always), ids, chunks=[8] + [1] * 8, reference=model).ok


@pytest.mark.parametrize("cls", BROKEN_CLASSES, ids=lambda c: c.__name__)
def test_detector_catches_broken_positions(cls):
    """Each position bug leaves the uncached pass correct and breaks the cached one from the cache's start."""
    model = small_model()
    broken = broken_variant(cls, model)
    ids = random_ids(2, 20)
    with torch.no_grad():
        torch.testing.assert_close(broken(ids), model(ids), atol=1e-5, rtol=1e-5)  # hides without a cache
    report = check_cache_consistency(broken, ids, reference=model)
    assert not report.ok and report.first_bad_position == 10


@pytest.mark.parametrize("cls", BROKEN_CLASSES, ids=lambda c: c.__name__)
def test_broken_generation_diverges(cls):
    """The bug changes generated tokens: the first divergence is found."""
    model = small_model()
    prompt = random_ids(1, 8)
    good = generate(model, prompt, 20, cache=ConcatCache())
    bad = generate(broken_variant(cls, model), prompt, 20, cache=ConcatCache())
    assert first_token_divergence(good, bad) is not None
    assert first_token_divergence(good, good) is None


def test_edit_without_crop_is_stale_and_crop_fixes_it():
    model = small_model()
    ids = random_ids(1, 12)
    stale = edit_and_continue(model, ids, position=4, new_token=7, crop=False)
    fixed = edit_and_continue(model, ids, position=4, new_token=7, crop=True)
    assert stale["max_error"] > 1e-2 and fixed["max_error"] < 1e-4
    with pytest.raises(ValueError, match="position"):
        edit_and_continue(model, ids, position=12, new_token=7, crop=True)


def test_left_padded_batch_matches_each_prompt_alone(make_cache):
    """Positions from the pad mask and pads masked out: every row generates what its prompt does alone."""
    model = small_model()
    prompts = [random_ids(1, n, seed=n)[0] for n in (3, 9, 6, 1)]
    ids, mask = left_pad(prompts)
    batch = generate(model, ids, 10, cache=make_cache(30), pad_mask=mask)
    for i, p in enumerate(prompts):
        alone = generate(model, p[None], 10, cache=ConcatCache())
        assert torch.equal(batch.new_tokens[i], alone.new_tokens[0]), i
    assert padded_batch_agreement(model, prompts, 10, "fixed") == [True] * 4


def test_unmasked_pads_change_the_padded_rows():
    model = small_model()
    prompts = [random_ids(1, n, seed=n)[0] for n in (3, 9, 6)]
    agreement = padded_batch_agreement(model, prompts, 10, "no_mask")
    assert agreement[1]  # the longest prompt has no pads
    assert not all(agreement)


def test_positions_ignoring_padding_cancel_under_rope():
    """With rotary positions, a constant per-row offset cancels (relative positions are unchanged)."""
    model = small_model()
    prompts = [random_ids(1, n, seed=n)[0] for n in (3, 9, 6)]
    assert padded_batch_agreement(model, prompts, 10, "positions_ignore_padding") == [True] * 3


def test_padding_helpers():
    mask = torch.tensor([[False, False, True, True], [True, True, True, True]])
    assert positions_from_padding(mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    m = padded_causal_mask(mask, 2)  # last 2 of 4 positions
    assert m.shape == (2, 1, 2, 4)
    assert m[0, 0].tolist() == [[False, False, True, False], [False, False, True, True]]
    first = padded_causal_mask(mask, 4)[0, 0]
    assert first[0].tolist() == [True, False, False, False]  # a pad query sees only itself: no NaN
    with pytest.raises(ValueError, match="pad_mask"):
        positions_from_padding(torch.ones(2, 3))
    with pytest.raises(ValueError, match="pad_mask"):
        small_model()(random_ids(2, 3), pad_mask=torch.ones(2, 4, dtype=torch.bool))


@pytest.mark.parametrize("steps", [0, 1, 5, 40])
def test_bytes_written_counts_quadratic_and_linear(steps):
    """A ConcatCache writes the whole cache every step; a StaticCache only the new token (counted vs formula)."""
    model = small_model(q_heads=4, kv_heads=2)
    per_token = 2 * 2 * 2 * 8 * 4  # K and V, 2 layers, 2 KV heads, head 8, fp32
    prompt = random_ids(1, 3)
    for kind, cache in (("concat", ConcatCache()), ("static", StaticCache(3 + steps + 1))):
        generate(model, prompt, steps + 1, cache=cache)
        assert cache.bytes_written() == expected_bytes_written(kind, steps, per_token, prompt_len=3)
    with pytest.raises(ValueError, match="cache_kind"):
        expected_bytes_written("ring", 3, 8)


def test_expected_bytes_written_is_the_written_out_rule():
    """torch.cat's step i rewrites all prompt_len + i tokens (quadratic); a preallocated cache writes one (linear)."""
    # 3-token prompt, 4 steps, 8 bytes a token: cat writes 3, then 4 + 5 + 6 + 7 tokens; preallocated 3 + 4.
    assert expected_bytes_written("concat", 4, 8, prompt_len=3) == 8 * (3 + 4 + 5 + 6 + 7) == 200
    assert expected_bytes_written("static", 4, 8, prompt_len=3) == 8 * (3 + 4) == 56
    for n, p in [(0, 1), (1, 1), (10, 1), (100, 16), (1000, 7)]:
        assert expected_bytes_written("concat", n, 1, prompt_len=p) == (n + 1) * p + n * (n + 1) // 2
        assert expected_bytes_written("static", n, 1, prompt_len=p) == p + n


@pytest.mark.parametrize("steps", [1, 2, 9])
def test_append_cost_counts_what_each_layer_writes(steps):
    """The timed appends: torch.cat writes 1 + 2 + ... + steps tokens, the buffer one per append; both hold the same."""
    r = append_cost(steps, kv_heads=2, head_dim=4, repeats=2, device="cpu")
    per_token = 2 * 2 * 4 * 4  # K and V, 2 heads of 4 fp32 values
    assert r["steps"] == steps and r["bytes_per_token"] == per_token
    assert r["bytes_written"] == {"torch.cat": per_token * steps * (steps + 1) // 2, "preallocated": per_token * steps}
    assert r["bytes_written"]["torch.cat"] == expected_bytes_written("concat", steps - 1, per_token)
    assert r["same_keys"]
    for run in r["runs"].values():
        assert len(run["seconds"]) == 2 and all(s > 0 for s in run["seconds"])
        assert run["tokens"].tolist() == [list(range(steps))]  # every append was timed, in order
    with pytest.raises(ValueError, match="steps"):
        append_cost(0)


def test_decode_cost_decodes_the_same_tokens_with_both_caches():
    """Both sides are the real greedy decode: the tokens are the uncached model's."""
    model = small_model()
    runs = decode_cost(model, prompt_len=6, new_tokens=5, repeats=2)
    ids = torch.randint(model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(6))
    want = generate(model, ids, 6).new_tokens[:, 1:]  # token 0 is the prefill's choice, not a timed step
    assert set(runs) == {"torch.cat", "preallocated"}
    for run in runs.values():
        assert torch.equal(run["tokens"], want) and len(run["seconds"]) == 2


def test_interrupted_pass_without_a_transaction_corrupts_the_cache():
    """Ctrl-C after layer 0 wrote: without a transaction layer 0 holds the extra tokens and the resumed run is wrong."""
    model = small_model(layers=3)
    ids = random_ids(1, 16)
    broken = interrupted_pass(broken_variant(BrokenNoTransaction, model), ids, prefill=10, interrupt_after_layer=0)
    assert broken["layer_tokens"][0] == 16 and broken["seq_len"] == 10  # layer 0 is one append ahead
    assert broken["max_error"] > 0.05
    fixed = interrupted_pass(model, ids, prefill=10, interrupt_after_layer=1)
    assert fixed["layer_tokens"] == [10, 10, 10] and fixed["seq_len"] == 10
    assert fixed["max_error"] < 1e-4
    with pytest.raises(ValueError, match="prefill"):
        interrupted_pass(model, ids, prefill=16, interrupt_after_layer=0)
    with pytest.raises(ValueError, match="interrupt_after_layer"):
        interrupted_pass(model, ids, prefill=4, interrupt_after_layer=3)


def test_append_cost_figure_has_a_line_per_row_size_and_side():
    import matplotlib

    matplotlib.use("Agg")
    from kvlessons import plots

    medians = {"big": {"torch.cat": [(2, 1, 3), (4, 3, 5)], "preallocated": [(1, 1, 1), (1, 1, 1)]},
               "small": {"torch.cat": [(1, 1, 1), (1, 1, 1)], "preallocated": [(2, 2, 2), (2, 2, 2)]}}
    fig = plots.plot_append_cost(medians, [64, 128], "t")
    ax = fig.axes[0]
    assert len(ax.containers) == 4
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "torch.cat, big", "preallocated, big", "torch.cat, small", "preallocated, small"]
    assert ax.containers[0].lines[0].get_linestyle() != ax.containers[2].lines[0].get_linestyle()  # row sizes differ

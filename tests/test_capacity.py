"""The KV-cache capacity of an engine of vLLM's design (lesson 11), checked against vLLM's own start-up logs.

Expected figures are either worked out here from the rule (bytes per token = 2 x layers
x KV heads x head_dim x bytes, a block = block_size tokens of that, blocks = budget //
block) or quoted from a published log, with its address. Logged GiB figures are
rounded to two decimals, so a log pins a block count to a small range, computed here.
"""

import math

import pytest

from kvlessons import ModelShape
from kvlessons.memory import PRESETS
from kvlessons.serving.capacity import (
    ENGINE_KNOBS, GIB, bytes_per_block, capacity_from_budget, engine_capacity, memory_account,
)

MIB = 2**20
# Llama-3.1-8B(-Instruct): 32 layers, 32 query heads, 8 KV heads, hidden 4096 (head_dim 128), bf16.
LLAMA31_8B = ModelShape(layers=32, q_heads=32, kv_heads=8, head_dim=128)
LLAMA31_BLOCK = 16 * 2 * 32 * 8 * 128 * 2  # 16 tokens x K,V x layers x KV heads x head_dim x 2 bytes = 2 MiB
# Qwen3-14B: 40 layers, 40 query heads, 8 KV heads of width 128, hidden 5120, bf16.
QWEN3_14B = ModelShape(layers=40, q_heads=40, kv_heads=8, head_dim=128, hidden_size=5120)
QWEN3_BLOCK = 16 * 2 * 40 * 8 * 128 * 2  # 2.5 MiB


def blocks_in(lo_gib: float, hi_gib: float, block: int) -> range:
    """Block counts a budget between lo and hi GiB can give (both ends included)."""
    return range(math.floor(lo_gib * GIB / block), math.floor(hi_gib * GIB / block) + 1)


# --- the block is lesson 02's formula times block_size ------------------------------------------

def test_block_bytes_written_out():
    assert LLAMA31_BLOCK == 2 * MIB
    assert bytes_per_block(LLAMA31_8B) == 2 * MIB
    assert bytes_per_block(LLAMA31_8B, block_size=32) == 4 * MIB
    assert bytes_per_block(LLAMA31_8B, model_dtype="fp32") == 4 * MIB
    assert bytes_per_block(LLAMA31_8B, model_dtype="bfloat16") == 2 * MIB
    assert bytes_per_block(QWEN3_14B) == QWEN3_BLOCK == 2_621_440


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_cache_is_one_byte_per_value(kv_cache_dtype):
    assert bytes_per_block(LLAMA31_8B, kv_cache_dtype=kv_cache_dtype) == 1 * MIB
    assert bytes_per_block(LLAMA31_8B, kv_cache_dtype=kv_cache_dtype, model_dtype="fp32") == 1 * MIB


def test_only_cache_owning_layers_and_latents_count():
    shared = ModelShape(layers=4, q_heads=2, kv_heads=2, head_dim=8, kv_owners=(0, 0, 2, 2))
    assert bytes_per_block(shared, block_size=4) == 4 * 2 * 2 * 2 * 8 * 2  # 4 tokens, 2 owners, K,V, 2 heads, 8, 2 B
    # DeepSeek-V3 (MLA): one 576-wide latent per layer per token, 61 layers.
    assert bytes_per_block("DeepSeek-V3") == 16 * 61 * 576 * 2


def test_preset_name_preset_and_shape_agree():
    by_name = capacity_from_budget("Llama-3-8B", 10 * GIB, max_model_len=4096)
    by_preset = capacity_from_budget(PRESETS["Llama-3-8B"], 10 * GIB, max_model_len=4096)
    by_shape = capacity_from_budget(LLAMA31_8B, 10 * GIB, max_model_len=4096)  # Llama-3.1-8B's cache = Llama-3-8B's
    assert by_name.num_blocks == by_preset.num_blocks == by_shape.num_blocks == 10 * GIB // (2 * MIB)
    assert by_name.model == "Llama-3-8B"


# --- the subtraction, on round numbers ---------------------------------------------------------

def test_subtraction_on_round_numbers():
    cap = engine_capacity("Llama-3-8B", 80 * GIB, gpu_memory_utilization=0.9, weights_bytes=16 * GIB,
                          activation_peak_bytes=2 * GIB, non_torch_bytes=GIB // 2, max_model_len=8192)
    # 80 x 0.9 = 72 GiB; 72 - 16 - 2 - 0.5 = 53.5 GiB; / 2 MiB = 27,392 blocks; x 16 = 438,272 tokens.
    assert cap.kv_cache_bytes == 53 * GIB + GIB // 2
    assert cap.bytes_per_block == 2 * MIB
    assert cap.num_blocks == 27_392
    assert cap.tokens == 438_272
    assert cap.max_concurrency == pytest.approx(438_272 / 8192) == 53.5
    assert cap.sequences_at(8192) == 27_392 // 512 == 53  # 512 whole blocks each
    assert cap.sequences_at(100) == 256  # 7 blocks each would allow 3,913: max_num_seqs caps it
    assert cap.memory.usable_bytes == pytest.approx(72 * GIB)


def test_every_term_is_subtracted():
    base = dict(weights_bytes=16 * GIB, activation_peak_bytes=2 * GIB, non_torch_bytes=GIB, max_model_len=1024)
    full = engine_capacity("Llama-3-8B", 80 * GIB, gpu_memory_utilization=1.0, **base).num_blocks
    assert full == (80 - 16 - 2 - 1) * 512
    for term in ("weights_bytes", "activation_peak_bytes", "non_torch_bytes"):
        more = dict(base, **{term: base[term] + GIB})
        assert engine_capacity("Llama-3-8B", 80 * GIB, gpu_memory_utilization=1.0, **more).num_blocks == full - 512
    half = engine_capacity("Llama-3-8B", 80 * GIB, gpu_memory_utilization=0.5, **base).num_blocks
    assert half == (40 - 16 - 2 - 1) * 512


def test_fp8_cache_doubles_the_blocks_of_the_same_budget():
    kw = dict(weights_bytes=16 * GIB, activation_peak_bytes=2 * GIB, non_torch_bytes=GIB // 2, max_model_len=8192)
    bf16 = engine_capacity("Llama-3-8B", 80 * GIB, **kw)
    fp8 = engine_capacity("Llama-3-8B", 80 * GIB, kv_cache_dtype="fp8", **kw)
    assert (bf16.num_blocks, fp8.num_blocks) == (27_392, 54_784)
    assert fp8.cache_dtype == "fp8" and bf16.cache_dtype == "bf16"


def test_a_partial_block_is_not_a_block():
    assert capacity_from_budget(LLAMA31_8B, 10 * 2 * MIB - 1, max_model_len=16).num_blocks == 9
    assert capacity_from_budget(LLAMA31_8B, 10 * 2 * MIB, max_model_len=16).num_blocks == 10
    assert capacity_from_budget(LLAMA31_8B, 10.5 * 2 * MIB, max_model_len=16).num_blocks == 10


# --- vLLM's published logs --------------------------------------------------------------------

# https://github.com/vllm-project/vllm/issues/10517, Llama-3.1-8B-Instruct on an RTX 3090, --max-model-len 20000:
#   Loading model weights took 14.9888 GB
#   Memory profiling results: total_gpu_memory=23.58GiB ... peak_torch_memory=17.06GiB ...
#   non_torch_memory=0.35GiB kv_cache_size=3.81GiB gpu_memory_utilization=0.90
#   GPU blocks: 1952, # CPU blocks: 2048
#   Maximum concurrency for 20000 tokens per request: 1.56x
# peak_torch_memory is the weights plus the profiling pass's activation peak.
def rtx3090(peak_torch_gib, max_model_len, **kw):
    return engine_capacity(LLAMA31_8B, 23.58 * GIB, gpu_memory_utilization=0.90, weights_bytes=14.9888 * GIB,
                           activation_peak_bytes=(peak_torch_gib - 14.9888) * GIB, non_torch_bytes=0.35 * GIB,
                           max_model_len=max_model_len, **kw)


def test_vllm_10517_blocks_from_the_logged_memory():
    cap = rtx3090(17.06, 20000)
    # Each logged term is within 0.005 GiB of the truth: the budget lies in
    # [23.575 x 0.9 - 17.065 - 0.355, 23.585 x 0.9 - 17.055 - 0.345] GiB, and the logged
    # kv_cache_size in [3.805, 3.815] GiB. Both ranges must hold vLLM's 1952 and ours.
    from_inputs = blocks_in(23.575 * 0.9 - 17.065 - 0.355, 23.585 * 0.9 - 17.055 - 0.345, LLAMA31_BLOCK)
    from_size = blocks_in(3.805, 3.815, LLAMA31_BLOCK)
    assert (from_inputs[0], from_inputs[-1]) == (1944, 1959)
    assert (from_size[0], from_size[-1]) == (1948, 1953)
    assert 1952 in from_inputs and 1952 in from_size
    assert cap.num_blocks in from_inputs and cap.num_blocks in from_size
    assert round(cap.kv_cache_bytes / GIB, 2) == 3.81


def test_vllm_10517_tokens_and_concurrency_from_the_logged_blocks():
    cap = capacity_from_budget(LLAMA31_8B, 1952 * LLAMA31_BLOCK, max_model_len=20000)
    assert cap.num_blocks == 1952
    assert cap.tokens == 1952 * 16 == 31_232
    assert f"{cap.max_concurrency:.2f}" == "1.56"  # 31,232 / 20,000 = 1.5616
    assert "Maximum concurrency for 20,000 tokens per request: 1.56x" in cap.vllm_log()
    assert "# GPU blocks: 1952" in cap.vllm_log()


# Same thread, --max-model-len 29000 (a longer profiling pass, so a higher peak):
#   ... peak_torch_memory=17.98GiB ... non_torch_memory=0.35GiB kv_cache_size=2.89GiB ...
#   # GPU blocks: 1478, # CPU blocks: 2048
#   Maximum concurrency for 29000 tokens per request: 0.82x
#   The model's max seq len (29000) is larger than the maximum number of tokens that can be
#   stored in KV cache (23648). ...
def test_vllm_10517_too_long_a_context_refuses_to_start():
    cap = rtx3090(17.98, 29000, require_fit=False)
    from_size = blocks_in(2.885, 2.895, LLAMA31_BLOCK)
    assert (from_size[0], from_size[-1]) == (1477, 1482)
    assert 1478 in from_size and cap.num_blocks in from_size
    assert not cap.fits
    with pytest.raises(ValueError, match="max_model_len"):
        rtx3090(17.98, 29000)

    logged = capacity_from_budget(LLAMA31_8B, 1478 * LLAMA31_BLOCK, max_model_len=29000, require_fit=False)
    assert logged.tokens == 23_648
    assert f"{logged.max_concurrency:.2f}" == "0.82"  # 23,648 / 29,000 = 0.8154
    with pytest.raises(ValueError, match=r"max_model_len \(29,000\).*largest max_model_len that fits is 23,648"):
        capacity_from_budget(LLAMA31_8B, 1478 * LLAMA31_BLOCK, max_model_len=29000)
    assert capacity_from_budget(LLAMA31_8B, 1478 * LLAMA31_BLOCK, max_model_len=23_648).fits


# https://github.com/LMCache/LMCache/issues/1739, a vLLM V1 log, Qwen3-14B on one GPU:
#   Available KV cache memory: 6.51 GiB
#   GPU KV cache size: 42,656 tokens
#   Maximum concurrency for 32,768 tokens per request: 1.30x
def test_vllm_v1_log_qwen3_14b():
    assert 42_656 % 16 == 0 and 42_656 // 16 == 2666  # the logged token count is whole blocks
    from_size = blocks_in(6.505, 6.515, QWEN3_BLOCK)
    assert (from_size[0], from_size[-1]) == (2664, 2668)
    cap = capacity_from_budget(QWEN3_14B, 6.51 * GIB, max_model_len=32_768)
    assert 2666 in from_size and cap.num_blocks in from_size

    logged = capacity_from_budget(QWEN3_14B, 2666 * QWEN3_BLOCK, max_model_len=32_768)
    assert logged.tokens == 42_656
    assert "GPU KV cache size: 42,656 tokens" in logged.vllm_log()
    assert "Maximum concurrency for 32,768 tokens per request: 1.30x" in logged.vllm_log()
    assert logged.sequences_at(32_768) == 1  # 2,048 blocks each: one request, with 618 blocks to spare


# https://github.com/vllm-project/vllm/pull/13596 (V1 starts logging tokens) shows one run both ways:
#   # GPU blocks: 127626   /   GPU KV cache size: 2,042,016 tokens
#   Maximum concurrency for 2,048 tokens per request: 997.08x
# The PR names no model, so only blocks -> tokens -> concurrency is checked (any shape will do).
def test_vllm_13596_blocks_tokens_concurrency():
    cap = capacity_from_budget(LLAMA31_8B, 127_626 * LLAMA31_BLOCK, max_model_len=2048)
    assert cap.tokens == 2_042_016
    assert cap.vllm_log().splitlines() == [
        "# GPU blocks: 127626",
        "GPU KV cache size: 2,042,016 tokens",
        "Maximum concurrency for 2,048 tokens per request: 997.08x",
    ]


# --- what vLLM refuses -------------------------------------------------------------------------

def test_no_memory_for_one_block_says_how_much_is_missing():
    # 24 GiB x 0.5 = 12 GiB, all of it weights: nothing left, and a block needs 2 MiB.
    with pytest.raises(ValueError, match=r"no available memory for the cache blocks.*weights_bytes.*2 MiB is missing"):
        engine_capacity(LLAMA31_8B, 24 * GIB, gpu_memory_utilization=0.5, weights_bytes=12 * GIB,
                        activation_peak_bytes=0, max_model_len=16)
    # 1 GiB over the 12 GiB: 1 GiB + 2 MiB missing.
    with pytest.raises(ValueError, match=r"gpu_memory_utilization.*1 GiB is missing"):
        engine_capacity(LLAMA31_8B, 24 * GIB, gpu_memory_utilization=0.5, weights_bytes=12 * GIB,
                        activation_peak_bytes=GIB, max_model_len=16)
    with pytest.raises(ValueError, match=r"kv_cache_bytes .* less than one block.*1 B is missing"):
        capacity_from_budget(LLAMA31_8B, 2 * MIB - 1, max_model_len=16)
    # One block exactly is enough to start (for a 16-token context).
    assert capacity_from_budget(LLAMA31_8B, 2 * MIB, max_model_len=16).num_blocks == 1


def test_context_that_does_not_fit_names_the_largest_that_does():
    budget = 100 * 2 * MIB  # 100 blocks = 1,600 tokens
    assert capacity_from_budget(LLAMA31_8B, budget, max_model_len=1600).fits
    with pytest.raises(ValueError, match=r"max_model_len \(1,601\).*largest max_model_len that fits is 1,600.*1 more"):
        capacity_from_budget(LLAMA31_8B, budget, max_model_len=1601)
    cap = capacity_from_budget(LLAMA31_8B, budget, max_model_len=1601, require_fit=False)
    assert not cap.fits and cap.sequences_at(1601) == 0


# --- bad inputs: ValueError naming the argument -------------------------------------------------

GOOD = dict(weights_bytes=16 * GIB, activation_peak_bytes=2 * GIB, non_torch_bytes=0, gpu_memory_utilization=0.9,
            max_model_len=4096, block_size=16, kv_cache_dtype="auto", model_dtype="bf16", max_num_seqs=256)


@pytest.mark.parametrize("arg, value", [
    ("gpu_memory_utilization", 0), ("gpu_memory_utilization", 1.01), ("gpu_memory_utilization", -0.1),
    ("gpu_memory_utilization", "0.9"), ("gpu_memory_utilization", True),
    ("weights_bytes", -1), ("weights_bytes", "16GB"), ("weights_bytes", None), ("weights_bytes", float("nan")),
    ("activation_peak_bytes", -1), ("activation_peak_bytes", float("inf")),
    ("non_torch_bytes", -5), ("non_torch_bytes", True),
    ("block_size", 0), ("block_size", -16), ("block_size", 16.0), ("block_size", True),
    ("max_model_len", 0), ("max_model_len", -1), ("max_model_len", 2.5),
    ("max_num_seqs", 0),
    ("kv_cache_dtype", "fp4"), ("kv_cache_dtype", "bf16"), ("kv_cache_dtype", "int8"), ("kv_cache_dtype", None),
    ("model_dtype", "fp8"), ("model_dtype", "nvfp4"), ("model_dtype", "int4"), ("model_dtype", 16),
])
def test_bad_argument_raises_naming_it(arg, value):
    with pytest.raises(ValueError, match=arg):
        engine_capacity("Llama-3-8B", 80 * GIB, **dict(GOOD, **{arg: value}))


@pytest.mark.parametrize("value", [0, -GIB, "80GB", None, float("nan")])
def test_bad_gpu_memory_raises_naming_it(value):
    with pytest.raises(ValueError, match="gpu_memory_bytes"):
        engine_capacity("Llama-3-8B", value, **GOOD)
    with pytest.raises(ValueError, match="gpu_memory_bytes"):
        memory_account(value, weights_bytes=0, activation_peak_bytes=0)


@pytest.mark.parametrize("model", ["Llama-9-8B", "llama-3-8b", 42, None])
def test_unknown_model_raises_naming_it(model):
    with pytest.raises(ValueError, match="model must be"):
        engine_capacity(model, 80 * GIB, **GOOD)


@pytest.mark.parametrize("value", [-1, "1GiB", float("nan")])
def test_bad_budget_raises_naming_it(value):
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        capacity_from_budget(LLAMA31_8B, value, max_model_len=16)


def test_sequences_at_needs_a_positive_length():
    cap = capacity_from_budget(LLAMA31_8B, GIB, max_model_len=16)
    with pytest.raises(ValueError, match="seq_len"):
        cap.sequences_at(0)


# --- what a notebook prints ---------------------------------------------------------------------

def test_report_shows_every_term():
    cap = engine_capacity("Llama-3-8B", 80 * GIB, gpu_memory_utilization=0.9, weights_bytes=16 * GIB,
                          activation_peak_bytes=2 * GIB, non_torch_bytes=GIB // 2, max_model_len=8192)
    text = str(cap)
    for piece in ["Llama-3-8B", "bf16", "80.00 GiB x utilization 0.90", "72.00 GiB", "16.00 GiB", "2.00 GiB",
                  "0.50 GiB", "= KV cache", "53.50 GiB", "128 KiB", "2 MiB", "27,392 blocks = 438,272 token slots",
                  "53.50x", "at once: 53 (max_num_seqs 256)"]:
        assert piece in text, piece
    budget_only = str(capacity_from_budget(LLAMA31_8B, 53.5 * GIB, max_model_len=8192))
    assert "weights" not in budget_only and "27,392 blocks" in budget_only


# --- the knobs ---------------------------------------------------------------------------------

def test_engine_knobs_map_each_flag_to_the_course():
    rows = {k.concept: k for k in ENGINE_KNOBS}
    assert len(rows) == len(ENGINE_KNOBS)
    expected = {  # vLLM flag, SGLang flag, from each project's documented argument list
        "block (page) size": ("--block-size", "--page-size"),
        "cache dtype": ("--kv-cache-dtype", "--kv-cache-dtype"),
        "prefix caching": ("--enable-prefix-caching", "--disable-radix-cache"),
        "memory fraction": ("--gpu-memory-utilization", "--mem-fraction-static"),
        "running requests": ("--max-num-seqs", "--max-running-requests"),
        "context limit": ("--max-model-len", "--context-length"),
        "tokens per step": ("--max-num-batched-tokens", "--chunked-prefill-size"),
        "preemption": ("--preemption-mode", ""),
    }
    assert {c: (k.vllm, k.sglang) for c, k in rows.items()} == expected
    for knob in ENGINE_KNOBS:
        lessons = knob.lessons.split(", ")
        assert lessons and set(lessons) <= {"02", "05", "06", "10", "11"}, knob
        assert knob.controls
    assert "11" in rows["memory fraction"].lessons and "05" in rows["cache dtype"].lessons

import pytest
import torch

from conftest import feed_in_chunks, random_ids
from kvlessons.cache import ConcatCache, StaticCache
from kvlessons.gqa import convert_to_gqa
from kvlessons.pitfalls import left_pad
from kvlessons.generate import count_kv_work, generate
from kvlessons.memory import kv_cache_bytes
from kvlessons.model import TinyConfig, TinyDecoder
from kvlessons.crosslayer import DEEPSEEK_V41_FLASH, YOCODecoder, cla_config, count_layer_tokens, yoco_shape

BASE = TinyConfig(vocab_size=50, hidden_size=32, layers=6, q_heads=4, kv_heads=2, head_dim=8, mlp_hidden=48, seed=0)

SHARED_MODELS = {
    "cla2": lambda: TinyDecoder(cla_config(BASE, 2)),
    "cla3": lambda: TinyDecoder(cla_config(BASE, 3)),
    "yoco": lambda: YOCODecoder(BASE, window=5),
    "yoco-mqa": lambda: YOCODecoder(TinyConfig(**{**BASE.__dict__, "kv_heads": 1}), window=4),
}
CHUNKINGS = {"whole": [23], "uneven": [7, 1, 12, 3], "decode": [9] + [1] * 14}


@pytest.mark.parametrize("chunking", sorted(CHUNKINGS))
@pytest.mark.parametrize("name", sorted(SHARED_MODELS))
def test_shared_cached_equals_uncached(make_cache, name, chunking, dev):
    """CLA and YOCO fed in chunks through either cache give the logits of one uncached pass."""
    model = SHARED_MODELS[name]().to(dev).eval()
    ids = random_ids(2, 23, dev=dev)
    with torch.inference_mode():
        reference = model(ids)
    got = feed_in_chunks(model, ids, CHUNKINGS[chunking], make_cache(23))
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(SHARED_MODELS))
def test_shared_generation_equals_recompute(make_cache, name, dev):
    model = SHARED_MODELS[name]().to(dev).eval()
    prompt = random_ids(1, 6, seed=2, dev=dev)
    slow, fast = generate(model, prompt, 15), generate(model, prompt, 15, cache=make_cache(21))
    assert torch.equal(slow.tokens, fast.tokens)
    torch.testing.assert_close(fast.logits, slow.logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(SHARED_MODELS))
@pytest.mark.parametrize("seq_len", [3, 11, 20])
def test_measured_bytes_equal_prediction(name, seq_len):
    """Only owners store: measured nbytes equals kv_cache_bytes of the model's shape (windows wrap in YOCO)."""
    model = SHARED_MODELS[name]().eval()
    concat, static = ConcatCache(), StaticCache(24)
    with torch.inference_mode():
        model(random_ids(2, seq_len), cache=concat)
        model(random_ids(2, seq_len), cache=static)
    assert concat.nbytes() == kv_cache_bytes(model.shape, seq_len, 2, "fp32")
    assert static.nbytes() == kv_cache_bytes(model.shape, 24, 2, "fp32")


def test_cla_divides_the_cache():
    """CLA-2 halves and CLA-3 thirds the baseline cache, measured."""
    ids = random_ids(1, 10)
    sizes = {}
    for factor in (1, 2, 3):
        cache = ConcatCache()
        with torch.inference_mode():
            TinyDecoder(cla_config(BASE, factor)).eval()(ids, cache=cache)
        sizes[factor] = cache.nbytes()
    assert sizes[1] == 2 * sizes[2] == 3 * sizes[3]


def test_cla_non_owners_have_no_kv_projections():
    model = TinyDecoder(cla_config(BASE, 3))
    assert [b.attn.projects_kv for b in model.blocks] == [True, False, False, True, False, False]
    assert not hasattr(model.blocks[1].attn, "k_proj")


def test_yoco_prefill_never_runs_the_upper_layers_over_the_prompt():
    """Prefill with last_only runs the upper half for one position per sequence; the lower half for all."""
    model = YOCODecoder(BASE, window=5).eval()
    with count_layer_tokens(model) as counts, torch.inference_mode():
        model(random_ids(2, 17), cache=ConcatCache(), last_only=True)
    assert counts == [34, 34, 34, 2, 2, 2]
    base = TinyDecoder(BASE).eval()
    with count_layer_tokens(base) as base_counts, torch.inference_mode():
        base(random_ids(2, 17), cache=ConcatCache(), last_only=True)
    assert base_counts == [34] * 6
    assert sum(counts) / sum(base_counts) < 0.55  # roughly half the layer-token passes


def test_yoco_generation_uses_last_only_and_matches():
    """generate() on YOCO never runs an upper layer over more than the last token per step."""
    model = YOCODecoder(BASE, window=5).eval()
    with count_layer_tokens(model) as counts:
        generate(model, random_ids(1, 12), 4, cache=ConcatCache())
    assert counts[3:] == [4, 4, 4]  # one position per step in each upper layer
    assert counts[:3] == [12 + 3] * 3


def test_yoco_lower_caches_stop_growing_at_the_window():
    model = YOCODecoder(BASE, window=5).eval()
    cache = ConcatCache()
    with torch.inference_mode():
        model(random_ids(1, 20), cache=cache)
    assert [cache.layer(i, window=5).held for i in range(3)] == [5, 5, 5]
    assert cache.layer(3).seq_len == 20


def test_count_kv_work_works_on_shared_models():
    model = TinyDecoder(cla_config(BASE, 2)).eval()
    with count_kv_work(model) as work:
        generate(model, random_ids(1, 1), 4)
    assert work.total == 10


@pytest.mark.parametrize("factor, match", [(0, "factor"), (4, "divide"), (-1, "factor")])
def test_invalid_cla_factor(factor, match):
    with pytest.raises(ValueError, match=match):
        cla_config(BASE, factor)


@pytest.mark.parametrize("layers, window, match", [(5, 4, "even"), (6, 0, "window")])
def test_invalid_yoco(layers, window, match):
    with pytest.raises(ValueError, match=match):
        YOCODecoder(TinyConfig(**{**BASE.__dict__, "layers": layers}), window=window)


def test_yoco_shape_counts_one_global_cache():
    """yoco_shape: lower layers windowed, upper layers all read layer L/2's cache."""
    s = yoco_shape(layers=4, q_heads=4, kv_heads=2, head_dim=8, window=3)
    assert s.cache_layers == [0, 1, 2]
    assert s.windows == (3, 3, None, None)


def test_deepseek_record_is_the_seed_figures():
    """The reported figures as the source text states them (not checkable here, only recorded)."""
    assert DEEPSEEK_V41_FLASH["layers"] == sum(DEEPSEEK_V41_FLASH["split"]) == 40
    assert DEEPSEEK_V41_FLASH["global_kv_bytes_per_token"] == 890
    assert set(DEEPSEEK_V41_FLASH["layer_kinds"]) == {"Full", "Reindex", "Reuse"}


def test_variant_shapes_per_token_bytes():
    """Past the window, YOCO adds one layer's K/V per token; CLA-2 half the layers; GQA-8 a quarter of MHA."""
    from kvlessons.memory import kv_bytes_per_token
    from kvlessons.crosslayer import variant_shapes

    v = variant_shapes(layers=32, q_heads=32, kv_heads=8, head_dim=128, window=4096, factor=2)
    b = {name: kv_bytes_per_token(s, "bf16", position=10_000) for name, s in v.items()}
    assert b["MHA"] == 512 * 1024 and b["GQA-8"] == 128 * 1024
    assert b["GQA-8 + CLA-2"] == 64 * 1024 and b["MHA + CLA-2"] == 256 * 1024
    assert b["YOCO + GQA-8"] == 2 * 8 * 128 * 2 and b["YOCO (MHA)"] == 2 * 32 * 128 * 2


def test_format_layers_names_each_role():
    from kvlessons.crosslayer import format_layers

    text = format_layers(yoco_shape(4, 4, 2, 8, 16), global_from=2)
    lines = text.splitlines()[1:]
    assert "sliding window 16" in lines[0] and "own K/V" in lines[0]
    assert all("global K/V" in line for line in lines[2:])
    cla = format_layers(cla_config(BASE, 3).shape)
    assert "reads layer 0's K/V" in cla.splitlines()[2]


@pytest.mark.parametrize("name", ["yoco", "cla2"])
def test_left_padded_batch_equals_each_prompt_alone(make_cache, name, dev):
    """A left-padded batch (pad_mask) through YOCO or CLA generates what each prompt generates alone,
    past the window too (the window layers' keys get the matching slice of the padding mask)."""
    model = SHARED_MODELS[name]().to(dev).eval()
    prompts = [random_ids(1, n, seed=n, dev=dev)[0] for n in (3, 9, 6)]
    ids, mask = left_pad(prompts)
    batch = generate(model, ids, 12, cache=make_cache(9 + 12), pad_mask=mask)
    for row, prompt in enumerate(prompts):
        alone = generate(model, prompt[None], 12, cache=make_cache(len(prompt) + 12))
        assert torch.equal(batch.new_tokens[row], alone.new_tokens[0]), row
        torch.testing.assert_close(batch.logits[row], alone.logits[0], atol=1e-5, rtol=1e-5)


def test_convert_to_gqa_refuses_yoco_and_handles_cla():
    """A YOCO decoder's global K/V is not per-layer heads: refused with ValueError. CLA converts (owners only)."""
    with pytest.raises(ValueError, match="YOCODecoder"):
        convert_to_gqa(SHARED_MODELS["yoco"](), 1)
    cla = SHARED_MODELS["cla2"]().eval()
    merged = convert_to_gqa(cla, 1)
    assert merged.config.kv_owners == cla.config.kv_owners
    w = cla.blocks[0].attn.k_proj.weight.view(2, 8, -1).mean(0)  # the two KV heads of layer 0, averaged
    torch.testing.assert_close(merged.blocks[0].attn.k_proj.weight, w)
    assert not hasattr(merged.blocks[1].attn, "k_proj")


def test_yoco_is_a_config_of_the_one_decoder():
    """YOCO is TinyDecoder's forward pass with a layer role: config.shape and shape agree, the
    global K/V block has its own norm, and a bad global_kv_layer is refused."""
    from dataclasses import replace

    model = SHARED_MODELS["yoco"]()
    assert model.config.shape == model.shape == yoco_shape(6, 4, 2, 8, 5, 32)
    assert type(model).forward is TinyDecoder.forward
    assert model.config.global_kv_layer == 3 and model.blocks[3].kv_norm is not None
    assert all(model.blocks[i].kv_norm is None for i in (0, 1, 2, 4, 5))
    same = TinyDecoder(model.config)  # the config alone rebuilds the same model
    ids = random_ids(1, 9)
    with torch.inference_mode():
        torch.testing.assert_close(same(ids), model(ids))
    for bad in (2, 4, 6):  # layer 2 owns a windowed cache, layer 4 reads 3's, 6 is past the end
        with pytest.raises(ValueError, match="global_kv_layer"):
            replace(model.config, global_kv_layer=bad)


def test_yoco_prefill_carries_one_position_through_the_upper_half():
    """With last_only the upper blocks carry 1 position, the global K/V still caches all of them,
    and the last position's logits equal a full pass's."""
    model = SHARED_MODELS["yoco"]().eval()
    ids = random_ids(2, 12)
    cache = ConcatCache()
    with count_layer_tokens(model) as counts, torch.inference_mode():
        last = model(ids, cache=cache, last_only=True)
    assert counts == [24, 24, 24, 2, 2, 2]  # batch 2 x 12 positions below, batch 2 x 1 above
    with torch.inference_mode():
        full = model(ids)
    assert cache.layer(3).seq_len == 12
    torch.testing.assert_close(last, full[:, -1:], atol=1e-5, rtol=1e-5)

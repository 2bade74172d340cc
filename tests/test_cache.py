import pytest
import torch

from conftest import HEAD_LAYOUTS, feed_in_chunks, random_ids, small_model
from kvlessons.cache import CacheInterruptedError, ConcatCache, StaticCache
from kvlessons.generate import generate

CHUNKINGS = {
    "whole": [23],
    "uneven": [7, 1, 12, 3],
    "one-by-one": [1] * 23,
    "prefill-then-decode": [10] + [1] * 13,
    "two-turns": [5, 11, 1, 1, 5],
}


@pytest.mark.parametrize("layout", sorted(HEAD_LAYOUTS))
@pytest.mark.parametrize("chunking", sorted(CHUNKINGS))
def test_cached_equals_uncached(variant, layout, chunking, dev):
    """Feeding a sequence in chunks through a cache gives the logits of one uncached pass, for every variant."""
    model = variant.model(*HEAD_LAYOUTS[layout], dev=dev)
    ids = random_ids(variant.max_batch, 23, dev=dev)
    with torch.inference_mode():
        reference = model(ids)  # (B, T, vocab), no cache: positions 0..T-1 in one pass
    cache = variant.make_cache(model, 23)
    got = feed_in_chunks(model, ids, CHUNKINGS[chunking], cache)
    assert cache.seq_len == 23
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", sorted(HEAD_LAYOUTS))
def test_cached_generation_equals_recompute(variant, layout, dev):
    """Greedy generation with a cache picks the same tokens from the same logits as recomputing."""
    model = variant.model(*HEAD_LAYOUTS[layout], dev=dev)
    prompt = random_ids(variant.max_batch, 6, seed=3, dev=dev)
    slow = generate(model, prompt, 20)
    fast = generate(model, prompt, 20, cache=variant.make_cache(model, 26))
    assert torch.equal(slow.tokens, fast.tokens)
    torch.testing.assert_close(fast.logits, slow.logits, atol=1e-5, rtol=1e-5)


def test_generate_twice_after_reset(variant, dev):
    """reset() empties the cache: a second generation gives the same tokens and logits as the first."""
    model = variant.model(dev=dev)
    prompt = random_ids(1, 5, dev=dev)
    cache = variant.make_cache(model, 30)
    first = generate(model, prompt, 12, cache=cache)
    assert cache.seq_len == 5 + 12 - 1
    cache.reset()
    assert cache.seq_len == 0
    second = generate(model, prompt, 12, cache=cache)
    assert torch.equal(first.tokens, second.tokens)
    torch.testing.assert_close(first.logits, second.logits)


def test_forgetting_reset_changes_the_output(variant, dev):
    """Without reset() the second prompt is read as a continuation, so its logits differ (the stale-cache bug)."""
    model = variant.model(dev=dev)
    prompt = random_ids(1, 5, dev=dev)
    cache = variant.make_cache(model, 40)
    first = generate(model, prompt, 6, cache=cache)
    stale = generate(model, prompt, 6, cache=cache)
    assert not torch.allclose(first.logits, stale.logits)


def test_crop_then_edit_equals_uncached(make_cache, dev):
    """Cropping to before an edited token and re-feeding the rest matches an uncached pass over the edited text."""
    model = small_model(dev=dev)
    ids = random_ids(1, 12, dev=dev)
    edited = ids.clone()
    edited[0, 8] = (edited[0, 8] + 1) % 50
    with torch.inference_mode():
        cache = make_cache(12)
        model(ids, cache=cache)
        cache.crop(8)
        tail = model(edited[:, 8:], cache=cache)
        torch.testing.assert_close(tail, model(edited)[:, 8:], atol=1e-5, rtol=1e-5)


def test_crop_last_token_then_edit_equals_uncached(variant, dev):
    """Every variant can take back its last token (within any window) and continue from an edited one."""
    model = variant.model(dev=dev)
    ids = random_ids(1, 12, dev=dev)
    edited = ids.clone()
    edited[0, 11] = (edited[0, 11] + 1) % 50
    with torch.inference_mode():
        cache = variant.make_cache(model, 16)
        model(ids, cache=cache)
        cache.crop(11)
        assert cache.seq_len == 11
        tail = model(edited[:, 11:], cache=cache)
        torch.testing.assert_close(tail, model(edited)[:, 11:], atol=1e-5, rtol=1e-5)


# -- all or nothing ------------------------------------------------------------------------------


def cache_state(cache):
    """Everything a reader of ``cache`` can see: counters, bytes, and each layer's held K/V."""
    layers = []
    for layer in cache.layers():
        k, v = layer.keys, layer.values
        layers.append((layer.seq_len, None if k is None else k.clone(), None if v is None else v.clone()))
    return cache.seq_len, cache.nbytes(), layers


def assert_same_state(before, after):
    assert after[:2] == before[:2]  # seq_len and nbytes
    assert len(after[2]) == len(before[2])
    for (n0, k0, v0), (n1, k1, v1) in zip(before[2], after[2]):
        assert n1 == n0
        for a, b in ((k0, k1), (v0, v1)):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a, b)


def raise_in(model, where, exc):
    """A hook that raises ``exc`` in the middle block (after it wrote its cache) or in the final norm (after every layer)."""
    module = model.blocks[len(model.blocks) // 2] if where == "middle-layer" else model.norm

    def hook(*_):
        raise exc

    return module.register_forward_hook(hook)


@pytest.mark.parametrize("where", ["middle-layer", "after-last-layer"])
@pytest.mark.parametrize("exc", [RuntimeError("out of memory (simulated)"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_failed_pass_leaves_the_cache_as_it_was(variant, where, exc, dev):
    """An exception after some (or all) layers wrote leaves the cache exactly as before; the next passes are right."""
    model = variant.model(layers=4, dev=dev) if "layers" not in variant.overrides else variant.model(dev=dev)
    ids = random_ids(variant.max_batch, 16, dev=dev)
    with torch.inference_mode():
        reference = model(ids)
        cache = variant.make_cache(model, 16)
        first = model(ids[:, :9], cache=cache)
        before = cache_state(cache)
        handle = raise_in(model, where, exc)
        with pytest.raises(type(exc)):
            model(ids[:, 9:12], cache=cache)  # a multi-token append into a non-empty cache
        handle.remove()
        assert_same_state(before, cache_state(cache))
        rest = [model(ids[:, 9:12], cache=cache), model(ids[:, 12:13], cache=cache), model(ids[:, 13:], cache=cache)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), reference, atol=1e-5, rtol=1e-5)


def test_failed_first_pass_leaves_an_empty_cache(variant, dev):
    """A failure in the very first pass (layers created during it) leaves the cache as new."""
    model = variant.model(dev=dev)
    ids = random_ids(variant.max_batch, 6, dev=dev)
    cache = variant.make_cache(model, 6)
    before = cache_state(cache)
    handle = raise_in(model, "after-last-layer", KeyboardInterrupt())
    with torch.inference_mode(), pytest.raises(KeyboardInterrupt):
        model(ids, cache=cache)
    handle.remove()
    assert_same_state(before, cache_state(cache))
    with torch.inference_mode():
        torch.testing.assert_close(model(ids, cache=cache), model(ids), atol=1e-5, rtol=1e-5)


def test_bad_token_id_changes_nothing(variant, dev):
    """An id outside the vocabulary is refused with ValueError before any layer writes."""
    model = variant.model(dev=dev)
    cache = variant.make_cache(model, 10)
    with torch.inference_mode():
        model(random_ids(1, 4, dev=dev), cache=cache)
        before = cache_state(cache)
        for bad in (50, -1):
            with pytest.raises(ValueError, match="vocab_size"):
                model(torch.tensor([[1, bad]], device=dev), cache=cache)
        assert_same_state(before, cache_state(cache))


def test_interrupted_restore_refuses_until_reset(dev):
    """If the restore itself is interrupted, the cache refuses the next pass, saying to reset(); reset() recovers."""
    model = small_model(dev=dev)
    ids = random_ids(1, 8, dev=dev)
    cache = ConcatCache()
    with torch.inference_mode():
        model(ids[:, :4], cache=cache)
        layer = cache.layers()[0]

        def restore_interrupted(state):
            raise KeyboardInterrupt

        layer.restore = restore_interrupted
        handle = raise_in(model, "after-last-layer", RuntimeError("boom"))
        with pytest.raises(KeyboardInterrupt):
            model(ids[:, 4:6], cache=cache)
        handle.remove()
        del layer.restore
        with pytest.raises(CacheInterruptedError, match=r"reset\(\)"):
            model(ids[:, 4:6], cache=cache)
        with pytest.raises(CacheInterruptedError):
            cache.crop(2)
        cache.reset()
        torch.testing.assert_close(model(ids, cache=cache), model(ids), atol=1e-5, rtol=1e-5)


def test_full_static_cache_refuses_and_is_unchanged(dev):
    """Appending past max_len raises ValueError before any layer is written; the cache still works after."""
    model = small_model(dev=dev)
    ids = random_ids(1, 10, dev=dev)
    cache = StaticCache(max_len=9)
    with torch.inference_mode():
        model(ids[:, :7], cache=cache)
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers()]
        nbytes = cache.nbytes()
        with pytest.raises(ValueError, match="full"):
            model(ids[:, 7:10], cache=cache)  # 7 + 3 > 9
        assert cache.seq_len == 7
        assert cache.nbytes() == nbytes
        for layer, (k, v) in zip(cache.layers(), before):
            assert layer.seq_len == 7
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
        # Still consistent: two more tokens fit and match the uncached reference.
        out = model(ids[:, 7:9], cache=cache)
        torch.testing.assert_close(out, model(ids[:, :9])[:, 7:], atol=1e-5, rtol=1e-5)


def test_static_layer_refuses_on_its_own():
    """A StaticLayer used directly (not through the model) also refuses, unchanged."""
    layer = StaticCache(4).layer(0)
    k = torch.ones(1, 2, 3, 8)
    layer.update(k, k)
    with pytest.raises(ValueError, match="max_len=4"):
        layer.update(k, k)
    assert layer.seq_len == 3


def test_nbytes_counts_what_is_stored(dev):
    """ConcatCache holds 2 * layers * kv_heads * head_dim * tokens * batch * 4 bytes; StaticCache holds max_len."""
    model = small_model(q_heads=4, kv_heads=2, dev=dev)
    ids = random_ids(3, 11, dev=dev)
    concat, static = ConcatCache(), StaticCache(16)
    assert concat.nbytes() == 0 and static.nbytes() == 0
    with torch.inference_mode():
        model(ids, cache=concat)
        model(ids, cache=static)
    per_token = 2 * 2 * 2 * 8 * 4  # K and V, 2 layers, 2 KV heads, head_dim 8, float32
    assert concat.nbytes() == per_token * 11 * 3
    assert static.nbytes() == per_token * 16 * 3


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_static_cache_rejects_bad_max_len(bad):
    """max_len must be a positive integer."""
    with pytest.raises(ValueError, match="max_len"):
        StaticCache(bad)


def test_update_rejects_mismatched_shapes(make_cache):
    """K and V of different shapes, or a changed head count, raise ValueError."""
    layer = make_cache(10).layer(0)
    with pytest.raises(ValueError, match="same shape"):
        layer.update(torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 4))
    layer.update(torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8))
    with pytest.raises(ValueError, match="does not match"):
        layer.update(torch.ones(1, 3, 1, 8), torch.ones(1, 3, 1, 8))
    assert layer.seq_len == 1


def test_crop_rejects_bad_lengths(make_cache):
    """crop to more than is held, or to a negative length, is an error."""
    cache = make_cache(10)
    cache.layer(0).update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    cache.advance(3)
    with pytest.raises(ValueError, match="length"):
        cache.crop(4)
    with pytest.raises(ValueError, match="length"):
        cache.crop(-1)
    cache.crop(0)
    assert cache.seq_len == 0 and cache.layer(0).seq_len == 0


def test_layer_index_must_be_non_negative():
    """cache.layer(-1) is a mistake, not Python's negative indexing."""
    with pytest.raises(ValueError, match="index"):
        ConcatCache().layer(-1)


WINDOWS = {"local-global": (4, None), "all-local": (3, 3), "wide-narrow": (7, 2)}


@pytest.mark.parametrize("windows", sorted(WINDOWS))
@pytest.mark.parametrize("chunking", sorted(CHUNKINGS))
def test_windowed_cached_equals_uncached(make_cache, windows, chunking, dev):
    """Sliding-window layers give the uncached logits after the window has wrapped, for any chunking."""
    model = small_model(q_heads=4, kv_heads=2, dev=dev, windows=WINDOWS[windows])
    ids = random_ids(2, 23, dev=dev)
    with torch.inference_mode():
        reference = model(ids)
    got = feed_in_chunks(model, ids, CHUNKINGS[chunking], make_cache(23))
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)


def test_window_changes_the_output(dev):
    """A window is not a no-op: past the window the logits differ from full attention."""
    ids = random_ids(1, 12, dev=dev)
    with torch.inference_mode():
        full = small_model(dev=dev)(ids)
        local = small_model(dev=dev, windows=(3, 3))(ids)
    torch.testing.assert_close(local[:, :3], full[:, :3])  # the first 3 tokens see everything either way
    assert not torch.allclose(local[:, 3:], full[:, 3:])


def test_window_layer_holds_only_the_window():
    """A growing window layer holds min(seq_len, W) positions; a static one holds min(max_len, W) from the start."""
    row = 2 * 8 * 4  # kv_heads x head_dim x float32 bytes, for K (same again for V)
    grow, fixed = ConcatCache().layer(0, window=5), StaticCache(40).layer(0, window=5)
    for n in range(1, 12):
        k = torch.full((1, 2, 1, 8), float(n))
        grow.update(k, k)
        fixed.update(k, k)
        assert grow.nbytes() == 2 * row * min(n, 5)
        assert fixed.nbytes() == 2 * row * 5
        # held keys are the newest positions, oldest first
        assert grow.keys[0, 0, :, 0].tolist() == [float(p) for p in range(max(1, n - 4), n + 1)]
        assert torch.equal(grow.keys, fixed.keys)


def test_window_layer_returns_what_new_queries_need():
    """A T-token append returns the held positions then the T new ones (the mask applies the window)."""
    layer = ConcatCache().layer(0, window=3)
    k = torch.arange(10.0).view(1, 1, 10, 1)
    layer.update(k[:, :, :6], k[:, :, :6])
    k_all, _ = layer.update(k[:, :, 6:10], k[:, :, 6:10])
    assert k_all.flatten().tolist() == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    assert layer.keys.flatten().tolist() == [7.0, 8.0, 9.0]


def test_window_crop_within_and_beyond_what_is_held(make_cache, dev):
    """Cropping inside the held window rewinds correctly; cropping past dropped positions refuses, unchanged."""
    model = small_model(dev=dev, windows=(4, 4))
    ids = random_ids(1, 14, dev=dev)
    with torch.inference_mode():
        cache = make_cache(14)
        model(ids[:, :10], cache=cache)
        with pytest.raises(ValueError, match="already dropped"):
            cache.crop(5)  # would need position 1; positions 0..5 are gone
        assert cache.seq_len == 10 and cache.layer(0, window=4).seq_len == 10
        cache.crop(9)  # needs positions 5..8, all held
        tail = model(ids[:, 9:14], cache=cache)
        torch.testing.assert_close(tail, model(ids)[:, 9:], atol=1e-5, rtol=1e-5)


def test_layer_window_mismatch_is_an_error():
    cache = ConcatCache()
    cache.layer(0, window=4)
    with pytest.raises(ValueError, match="window"):
        cache.layer(0)


def test_static_window_layer_refuses_more_than_max_len():
    """A windowed layer of a StaticCache holds at most max_len positions in all, like its full layers."""
    layer = StaticCache(4).layer(0, window=3)
    k = torch.ones(1, 1, 3, 2)
    layer.update(k, k)
    with pytest.raises(ValueError, match="max_len=4"):
        layer.update(k, k)
    assert layer.seq_len == 3
    layer.update(k[:, :, :1], k[:, :, :1])
    assert layer.seq_len == 4


@pytest.mark.parametrize("lengths", [[4, 4], [4, 3], [3, 3], [2, 1], [5, 4], [5, 5]])
def test_window_one_layer_crops_repeatedly(make_cache, lengths):
    """A window-1 query sees only itself, so a window-1 layer can be cropped to any length, again and again."""
    cache = make_cache(10)
    layer = cache.layer(0, window=1)
    for p in range(5):
        x = torch.full((1, 1, 1, 2), float(p))
        layer.update(x, x)
    cache.advance(5)
    for n in lengths:
        cache.crop(n)
        assert cache.seq_len == layer.seq_len == n
    x = torch.full((1, 1, 1, 2), 9.0)
    k_all, _ = layer.update(x, x)
    assert k_all[0, 0, -1].tolist() == [9.0, 9.0] and k_all.shape[2] <= 2  # the new key, at most one older
    assert layer.keys.flatten().tolist() == [9.0, 9.0]  # afterwards only the newest position is held


def test_crop_checks_every_layer_before_changing_any(make_cache):
    """A crop the last layer's window cannot serve is refused before the first layer is cropped."""
    cache = make_cache(12)
    full, local = cache.layer(0), cache.layer(1, window=2)
    for p in range(10):
        x = torch.full((1, 1, 1, 2), float(p))
        full.update(x, x)
        local.update(x, x)
    cache.advance(10)
    with pytest.raises(ValueError, match="already dropped"):
        cache.crop(4)
    assert cache.seq_len == full.seq_len == local.seq_len == 10
    assert full.keys[0, 0, :, 0].tolist() == [float(p) for p in range(10)]


def test_update_rejects_a_changed_dtype(make_cache):
    """A layer holding float32 refuses bfloat16 K/V (a silent cast or a half-done write otherwise)."""
    layer = make_cache(10).layer(0)
    layer.update(torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8))
    with pytest.raises(ValueError, match="bfloat16"):
        layer.update(torch.ones(1, 2, 1, 8, dtype=torch.bfloat16), torch.ones(1, 2, 1, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        layer.update(torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8, dtype=torch.float64))
    assert layer.seq_len == 1


def test_nbytes_is_what_the_tensors_hold(variant, dev):
    """nbytes() equals the bytes of the distinct tensor storages the cache keeps, found by walking it."""
    model = variant.model(dev=dev)
    cache = variant.make_cache(model, 40)
    generate(model, random_ids(1, 7, dev=dev), 30, cache=cache)
    if hasattr(cache, "paged"):  # a view reports its share of the shared pool, not the pool
        return
    seen, held = set(), 0
    stack = [cache]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                held += s.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    assert cache.nbytes() == held > 0

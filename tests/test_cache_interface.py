"""Every public function that takes a cache, run on every cache variant (tests/conftest.py's CACHE_VARIANTS).

The variants are exact (the quantized one keeps the whole sequence in its full-precision
tail), so each function must report what it reports for a plain full-precision cache.
"""

import torch

from conftest import random_ids
from kvlessons.fp4 import compare_generation, passage_agreement
from kvlessons.generate import feed_in_chunks, generate, trace_generation
from kvlessons.pitfalls import check_cache_consistency


def test_trace_generation(variant, dev):
    """trace_generation records the cache after every step and chooses generate's tokens."""
    model = variant.model(dev=dev)
    prompt = random_ids(1, 5, dev=dev)
    cache = variant.make_cache(model, 20)
    steps = trace_generation(model, prompt, 8, cache)
    assert [s.cached_tokens for s in steps] == list(range(5, 13))
    assert all(s.cache_bytes > 0 for s in steps)
    expected = generate(model, prompt, 8).new_tokens[0].tolist()
    assert [s.next_token for s in steps] == expected


def test_feed_in_chunks_and_the_detector(variant, dev):
    """The one chunked loop equals one uncached pass, and lesson 07's detector says OK, for any chunking."""
    model = variant.model(dev=dev)
    ids = random_ids(variant.max_batch, 14, dev=dev)
    for chunks in ([14], [6, 3, 1, 1, 3], [1] * 14):
        cache = variant.make_cache(model, 14)
        got = feed_in_chunks(model, ids, chunks, cache)
        assert cache.seq_len == 14
        with torch.inference_mode():
            torch.testing.assert_close(got, model(ids), atol=1e-5, rtol=1e-5)
        last = feed_in_chunks(model, ids, chunks, variant.make_cache(model, 14), last_only=True)
        ends = [sum(chunks[: i + 1]) - 1 for i in range(len(chunks))]
        torch.testing.assert_close(last, got[:, ends], atol=1e-5, rtol=1e-5)
        report = check_cache_consistency(model, ids, chunks, cache=variant.make_cache(model, 14))
        assert report.ok, report


def test_compare_generation_and_passage_agreement(variant, dev):
    """An exact cache agrees with full precision everywhere: free-running, teacher-forced, per passage position."""
    model = variant.model(dev=dev)
    prompt = random_ids(1, 6, dev=dev)
    cache = variant.make_cache(model, 30)
    r = compare_generation(model, prompt, 12, cache)
    assert r["free_running"] == 1.0 and r["teacher_forced"] == 1.0 and r["first_divergence"] is None
    assert r["max_logit_diff"] < 1e-4
    p = passage_agreement(model, random_ids(1, 20, seed=4, dev=dev), 8, variant.make_cache(model, 30))
    assert p["top1"] == 1.0 and p["kl"] < 1e-6 and p["max_logit_diff"] < 1e-4


def test_the_whole_interface_is_there(variant, dev):
    """layer(i), layers(), seq_len, advance via a pass, crop, reset, nbytes, transaction, atomic: on every variant."""
    model = variant.model(dev=dev)
    cache = variant.make_cache(model, 12)
    generate(model, random_ids(1, 6, dev=dev), 4, cache=cache)
    owners = model.shape.cache_layers
    assert [layer.seq_len for layer in cache.layers()] == [9] * len(owners) == [cache.layer(i, window=model.shape.window(i)).seq_len for i in owners]
    held = cache.nbytes()
    assert held == sum(layer.nbytes() for layer in cache.layers()) > 0
    cache.crop(8)  # within every window: the next query's keys are all still held
    assert cache.seq_len == 8 and all(layer.seq_len == 8 for layer in cache.layers())
    with cache.atomic():
        pass
    cache.reset()
    assert cache.seq_len == 0 and all(layer.seq_len == 0 for layer in cache.layers())

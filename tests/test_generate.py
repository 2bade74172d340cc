import pytest
import torch

from conftest import random_ids, small_model
from kvlessons.cache import ConcatCache, StaticCache
from kvlessons.generate import count_kv_work, expected_kv_work, generate, measure_kv_work, trace_generation


@pytest.mark.parametrize("n", [1, 2, 4, 9, 17])
def test_counted_work_is_triangular_without_cache_and_linear_with(n):
    """Writing n tokens from a 1-token prompt computes n(n+1)/2 K/V positions by recompute, n with a cache."""
    model = small_model()
    prompt = random_ids(1, 1)
    with count_kv_work(model) as slow:
        generate(model, prompt, n)
    with count_kv_work(model) as fast:
        generate(model, prompt, n, cache=ConcatCache())
    assert slow.total == n * (n + 1) // 2
    assert fast.total == n
    assert slow.per_forward == list(range(1, n + 1))
    assert fast.per_forward == [1] * n
    assert slow.per_layer_total == slow.total * 2


def test_the_four_token_example():
    """The source text's example: four tokens cost 10 K/V computations without a cache, 4 with one."""
    result = measure_kv_work(small_model(), [4])
    assert result == {"n": [4], "recompute": [10], "cached": [4]}


@pytest.mark.parametrize("prompt_len, n", [(1, 5), (3, 1), (6, 7), (10, 0)])
def test_expected_work_formula_matches_counts(prompt_len, n):
    """expected_kv_work agrees with what the instrument counts, for longer prompts too."""
    model = small_model()
    prompt = random_ids(2, prompt_len)
    for cache in (None, StaticCache(prompt_len + n + 1)):
        with count_kv_work(model) as work:
            generate(model, prompt, n, cache=cache)
        # batch 2: the instrument counts both sequences' positions
        assert work.total == 2 * expected_kv_work(prompt_len, n, cached=cache is not None)


def test_counter_detaches():
    """After the with-block the hook is gone: later forwards are not counted."""
    model = small_model()
    with count_kv_work(model) as work:
        model(random_ids(1, 3))
    model(random_ids(1, 3))
    assert work.per_forward == [3]


def test_generation_record(dev):
    """Generation holds the prompt plus new tokens, one logits row and one timing per step."""
    model = small_model(dev=dev)
    prompt = random_ids(2, 4, dev=dev)
    g = generate(model, prompt, 6, cache=ConcatCache())
    assert g.tokens.shape == (2, 10) and g.new_tokens.shape == (2, 6)
    assert torch.equal(g.tokens[:, :4], prompt)
    assert g.logits.shape == (2, 6, 50)
    assert torch.equal(g.logits.argmax(-1), g.new_tokens)
    assert len(g.step_times) == 6 and all(t > 0 for t in g.step_times)
    assert g.step_lengths == [4, 1, 1, 1, 1, 1]
    assert generate(model, prompt, 6).step_lengths == [4, 5, 6, 7, 8, 9]


def test_zero_new_tokens():
    """max_new_tokens=0 returns the prompt unchanged."""
    prompt = random_ids(1, 3)
    g = generate(small_model(), prompt, 0)
    assert torch.equal(g.tokens, prompt) and g.new_tokens.shape == (1, 0)


@pytest.mark.parametrize("kwargs, name", [(dict(max_new_tokens=-1), "max_new_tokens"), (dict(max_new_tokens=2.0), "max_new_tokens")])
def test_generate_rejects_bad_counts(kwargs, name):
    with pytest.raises(ValueError, match=name):
        generate(small_model(), random_ids(1, 3), **kwargs)


def test_generate_rejects_bad_prompts():
    """A 1-D or empty prompt is a ValueError."""
    with pytest.raises(ValueError, match="prompt_ids"):
        generate(small_model(), torch.tensor([1, 2]), 2)
    with pytest.raises(ValueError, match="prompt_ids"):
        generate(small_model(), torch.zeros(1, 0, dtype=torch.long), 2)


def test_expected_work_rejects_bad_lengths():
    with pytest.raises(ValueError, match="prompt_len"):
        expected_kv_work(0, 3, cached=True)
    with pytest.raises(ValueError, match="new_tokens"):
        expected_kv_work(2, -1, cached=False)


def test_trace_follows_the_cache():
    """Each traced step holds one more token and that many tokens' bytes; tokens match generate()."""
    model = small_model()
    prompt = random_ids(1, 4)
    trace = trace_generation(model, prompt, 5, ConcatCache())
    per_token = 2 * 2 * 2 * 8 * 4
    assert [s.cached_tokens for s in trace] == [4, 5, 6, 7, 8]
    assert [s.cache_bytes for s in trace] == [per_token * n for n in (4, 5, 6, 7, 8)]
    assert [s.next_token for s in trace] == generate(model, prompt, 5).new_tokens[0].tolist()
    for s in trace:
        assert 0 < sum(s.top_probs) <= 1 + 1e-6
        assert s.top_probs == sorted(s.top_probs, reverse=True)
        assert s.top_tokens[0] == s.next_token  # greedy picks the most likely token
    assert trace[-1].tokens == prompt[0].tolist() + [s.next_token for s in trace[:-1]]


def test_interrupted_generation_leaves_the_cache_as_before(variant, dev):
    """Ctrl-C during the 5th step of generate(): the steps that finished are undone too, so re-running gives the same tokens."""
    from test_cache import assert_same_state, cache_state

    model = variant.model(dev=dev)
    prompt = random_ids(1, 6, dev=dev)
    cache = variant.make_cache(model, 40)
    generate(model, prompt[:, :3], 2, cache=cache)  # the cache already holds something
    before = cache_state(cache)
    calls = []

    def ctrl_c_on_fifth_step(*_):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt

    handle = model.norm.register_forward_hook(ctrl_c_on_fifth_step)
    with pytest.raises(KeyboardInterrupt):
        generate(model, prompt, 10, cache=cache)
    handle.remove()
    assert_same_state(before, cache_state(cache))
    reference = variant.make_cache(model, 40)
    generate(model, prompt[:, :3], 2, cache=reference)
    assert torch.equal(generate(model, prompt, 10, cache=cache).tokens, generate(model, prompt, 10, cache=reference).tokens)


def test_feed_in_chunks_refuses_bad_chunks():
    """Chunks must be positive integers that add up to the tokens: each rule named, nothing fed."""
    from kvlessons.generate import feed_in_chunks

    model, cache = small_model(), ConcatCache()
    ids = random_ids(1, 6)
    for chunks, match in (([3, 0, 3], r"chunks\[1\] must be positive"), ([3, 2.0, 1], r"chunks\[1\] must be an integer"),
                          ([3, 2], "add up to the 6 tokens")):
        with pytest.raises(ValueError, match=match):
            feed_in_chunks(model, ids, chunks, cache)
    assert cache.seq_len == 0

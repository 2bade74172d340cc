"""Lesson 01's timing contenders: recomputing and prefilling do the work greedy decoding with a cache does."""

import pytest
import torch

from conftest import random_ids, small_model
from kvlessons import bench
from kvlessons.generate import generate


def test_recompute_stepper_writes_the_tokens_of_the_cached_stepper():
    """Step k of each feeds the same sequence and returns the same token: the k-th after the prefill's choice."""
    model = small_model()
    ids = random_ids(2, 5)
    want = generate(model, ids, 7).new_tokens  # uncached greedy: token 0 is the prefill's choice
    recompute, cached = bench.recompute_stepper(model, ids), bench.greedy_stepper(model, ids, 5 + 7)
    got_recompute = torch.cat([recompute() for _ in range(6)], dim=1)
    got_cached = torch.cat([cached() for _ in range(6)], dim=1)
    assert torch.equal(got_recompute, want[:, 1:]) and torch.equal(got_cached, want[:, 1:])


def test_recompute_stepper_runs_over_everything_so_far():
    """Each step is one forward pass over the prompt and every token chosen since: 6, 7, 8 tokens."""
    model = small_model()
    lengths = []
    model.register_forward_pre_hook(lambda _, args: lengths.append(args[0].shape[1]))
    step = bench.recompute_stepper(model, random_ids(1, 5))
    for _ in range(3):
        step()
    assert lengths == [5, 6, 7, 8]  # the prefill's choice, then three steps


def test_prefill_stepper_reads_the_whole_prompt_afresh_every_call():
    """Every call is the same work, one pass over the prompt into a new cache, and chooses the prefill's token."""
    model = small_model()
    ids = random_ids(2, 6)
    first = generate(model, ids, 1).new_tokens
    lengths = []  # (tokens fed, tokens the cache held before the pass), for every forward pass
    model.register_forward_pre_hook(lambda _, args, kwargs: lengths.append((args[0].shape[1], kwargs["cache"].seq_len)),
                                    with_kwargs=True)
    step = bench.prefill_stepper(model, ids)
    assert all(torch.equal(step(), first) for _ in range(3))
    assert lengths == [(6, 0)] * 3


def test_interleaved_recompute_and_cache_agree():
    """Timed side by side, the two choose the same tokens, and the comparison prints a sentence."""
    model = small_model()
    ids = random_ids(1, 8)
    runs = bench.interleaved_decode({"cache": lambda: bench.greedy_stepper(model, ids, 8 + 4),
                                     "recompute": lambda: bench.recompute_stepper(model, ids)}, 3, 2, "cpu")
    text = bench.format_decode_comparison(runs, baseline="cache")
    assert "every side chose the same tokens" in text
    assert all(len(run["seconds"]) == 2 for run in runs.values())


def test_interleaved_calls_alternates_and_drops_the_warm_up_round():
    from kvlessons.bench import interleaved_calls

    order = []
    seconds = interleaved_calls({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, repeats=3, device="cpu")
    assert order == ["a", "b"] * 4  # round 0 (warm-up) and 3 timed rounds, A, B, A, B, ...
    assert [len(v) for v in seconds.values()] == [3, 3]
    with pytest.raises(ValueError, match="repeats"):
        interleaved_calls({"a": lambda: None}, repeats=0, device="cpu")


def test_greedy_stepper_runs_on_any_cache_it_is_given():
    from kvlessons.cache import ConcatCache

    model, ids = small_model(), random_ids(1, 5)
    static, concat = bench.greedy_stepper(model, ids, 5 + 4), bench.greedy_stepper(model, ids, cache=ConcatCache())
    assert torch.equal(torch.cat([static() for _ in range(4)], 1), torch.cat([concat() for _ in range(4)], 1))
    for args in ({}, {"max_len": 9, "cache": ConcatCache()}):
        with pytest.raises(ValueError, match="exactly one"):
            bench.greedy_stepper(model, ids, **args)

import re

import pytest
import torch

from conftest import small_model
from kvlessons import bench


def test_decode_table_has_every_mode_and_speedup():
    """The benchmark table has a positive time per mode and the recompute/cached ratio (values not asserted)."""
    rows = bench.decode_table(small_model(), [8, 16], repeats=1)
    assert [r["seq_len"] for r in rows] == [8, 16]
    for r in rows:
        assert all(r[m] > 0 for m in bench.MODES)
        assert r["speedup"] == pytest.approx(r["recompute"] / min(r["concat"], r["static"]))
    text = bench.format_table(rows)
    assert "recompute ms/tok" in text and len(text.splitlines()) == 3


@pytest.mark.parametrize("mode", ["concat", "static"])
def test_decode_time_leaves_cache_state_repeatable(mode):
    """Every timed repeat starts from the same cached tokens, is cropped back to them, and predicts the same logits."""
    model = small_model()
    repeats = bench.decode_repeats(model, 5, mode, repeats=3)
    assert [(r.cached_before, r.cached_after) for r in repeats] == [(5, 5)] * 3
    for r in repeats[1:]:
        torch.testing.assert_close(r.logits, repeats[0].logits, atol=0, rtol=0)
    # ... and that step is the right one: the prediction one uncached pass over the same 6 tokens makes.
    (uncached,) = bench.decode_repeats(model, 5, "recompute", repeats=1)
    assert uncached.cached_before == uncached.cached_after == 0
    torch.testing.assert_close(repeats[0].logits, uncached.logits, atol=1e-5, rtol=1e-5)
    assert bench.decode_time(model, 5, mode, repeats=3) > 0


def test_interleaved_decode_alternates_sides_and_times_only_the_steps(monkeypatch):
    """Sides run A, B, A, B, ... after a warm-up round; each prefill is outside the timer (a fake clock shows it)."""
    clock, log = [0.0], []
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    def side(name, step_cost):
        def start():
            log.append(f"{name} prefill")
            clock[0] += 100.0  # a prefill this slow would swamp the steps if it were timed

            def step():
                log.append(name)
                clock[0] += step_cost
                return torch.tensor([[len(log)]])

            return step

        return start

    runs = bench.interleaved_decode({"A": side("A", 1.0), "B": side("B", 3.0)}, new_tokens=2, repeats=3, device="cpu")
    assert log == ["A prefill", "A", "A", "B prefill", "B", "B"] * 4  # round 0 warms up, then 3 kept
    assert runs["A"]["seconds"] == [1.0] * 3 and runs["B"]["seconds"] == [3.0] * 3  # seconds per step
    assert runs["A"]["tokens"].shape == (1, 2)


def test_ratio_sentence_follows_the_numbers():
    """Faster, slower, or no difference within noise, from the quartiles of the per-repeat ratios."""
    assert bench.ratio_sentence("a", [1.0, 1.0, 1.0], "b", [2.0, 1.8, 2.2]) == (
        "a is faster than b by 2.00x (spread 1.90-2.10x, quartiles of 3 paired repeats)")
    assert bench.ratio_sentence("a", [1.0, 1.0, 1.0], "b", [0.5, 0.5, 0.4]) == (
        "a is slower than b by 2.00x (spread 2.00-2.22x, quartiles of 3 paired repeats)")
    assert "no difference within noise" in bench.ratio_sentence("a", [1.0, 1.0, 1.0], "b", [1.1, 0.8, 1.3])
    # One stalled repeat (a once took 40 times as long) does not hide a clear difference.
    assert bench.ratio_sentence("a", [1.0] * 4 + [40.0], "b", [2.0, 2.1, 1.9, 2.0, 2.0]).startswith(
        "a is faster than b by 2.00x (spread 1.90-2.00x")
    with pytest.raises(ValueError, match="same number"):
        bench.ratio_sentence("a", [1.0], "b", [1.0, 2.0])


def test_median_and_quartiles():
    assert bench.median_and_quartiles([3.0]) == (3.0, 3.0, 3.0)
    assert bench.median_and_quartiles([5.0, 1.0, 2.0, 4.0, 3.0]) == (3.0, 2.0, 4.0)
    with pytest.raises(ValueError):
        bench.median_and_quartiles([])


def test_format_decode_comparison_shows_median_spread_and_tokens():
    runs = {
        "ours": {"seconds": [0.010, 0.012, 0.011], "tokens": torch.tensor([[1, 2]])},
        "theirs": {"seconds": [0.020, 0.030, 0.025], "tokens": torch.tensor([[1, 2]])},
    }
    lines = bench.format_decode_comparison(runs, baseline="ours").splitlines()
    assert "median" in lines[0] and "quartiles" in lines[0]
    assert lines[1].split() == ["ours", "11.0", "10.5-11.5", "10.0-12.0", "90.9"]
    assert lines[2].split() == ["theirs", "25.0", "22.5-27.5", "20.0-30.0", "40.0"]
    assert lines[3] == "ours is faster than theirs by 2.27x (spread 2.14-2.39x, quartiles of 3 paired repeats)"
    assert lines[4] == "every side chose the same tokens"
    runs["theirs"]["tokens"] = torch.tensor([[1, 3]])
    assert "different tokens" in bench.format_decode_comparison(runs, baseline="ours")


def test_prefill_time_runs():
    assert bench.prefill_time(small_model(), 12, repeats=2) > 0


def test_bad_mode_and_length():
    with pytest.raises(ValueError, match="mode"):
        bench.decode_time(small_model(), 4, "magic")
    with pytest.raises(ValueError, match="seq_len"):
        bench.decode_time(small_model(), 0, "concat")


def test_cli_prints_table(capsys):
    """python -m kvlessons.bench prints the machine line and one row per length."""
    bench.main(["--lengths", "8", "16", "--repeats", "1", "--paged-lengths", "32", "--no-real-model"])
    out = capsys.readouterr().out
    assert "torch" in out and "speedup" in out
    assert len([line for line in out.splitlines() if line.strip().startswith(("8 ", "16 "))]) == 2
    (paged_row,) = [line.split() for line in out.splitlines() if line.strip().startswith("32 ")]
    assert len(paged_row) == 7 and paged_row[5].endswith("x")  # seq_len, then a median (quartiles) per column
    assert all(re.fullmatch(r"\(\d+\.\d+-\d+\.\d+\)", cell) for cell in paged_row[2::2])


def test_paged_decode_time_reports_both_and_the_ratio():
    t = bench.paged_decode_time(64, block_size=8, repeats=3)
    assert len(t["contiguous"]) == len(t["paged"]) == len(t["ratio"]) == 3
    assert all(x > 0 for x in t["contiguous"] + t["paged"])
    assert t["ratio"] == pytest.approx([p / c for c, p in zip(t["contiguous"], t["paged"])])  # paired in order
    with pytest.raises(ValueError, match="repeats"):
        bench.paged_decode_time(64, repeats=0)


def test_paged_decode_time_alternates_the_sides(monkeypatch):
    """After one untimed call of each, contiguous and paged are timed in turn, and each time is its own side's alone."""
    import kvlessons.attention
    import kvlessons.paging

    clock, log = [0.0], []
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    def logged(name, fn, costs):
        costs = iter(costs)

        def run(*args, **kwargs):
            log.append(name)
            clock[0] += next(costs)
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(kvlessons.attention, "attend", logged("contiguous", kvlessons.attention.attend, [0.5, 1, 2, 3]))
    monkeypatch.setattr(kvlessons.paging, "paged_attention",
                        logged("paged", kvlessons.paging.paged_attention, [0.5, 6, 2, 9]))
    t = bench.paged_decode_time(40, block_size=8, repeats=3)
    assert sorted(log[:2]) == ["contiguous", "paged"] and log[2:] == ["contiguous", "paged"] * 3
    assert t["contiguous"] == [1, 2, 3] and t["paged"] == [6, 2, 9]
    assert t["ratio"] == [6, 1, 3]  # each paged repeat over the contiguous one timed just before it


def test_paged_decode_time_refuses_sides_that_disagree(monkeypatch):
    """Both sides must compute the same attention, or the timing compares different work."""
    import kvlessons.paging

    real = kvlessons.paging.paged_attention
    def wrong_blocks(q, pool, table, n):  # reads the next block of the pool in place of each one in the table
        return real(q, pool, (table + 1) % pool.shape[2], n)

    monkeypatch.setattr(kvlessons.paging, "paged_attention", wrong_blocks)
    with pytest.raises(AssertionError):
        bench.paged_decode_time(40, block_size=8, repeats=1)


def test_format_paged_table_shows_median_and_quartiles_of_each_side_and_of_the_ratio():
    t = {"contiguous": [0.001, 0.003, 0.002], "paged": [0.002, 0.009, 0.004], "ratio": [2.0, 3.0, 2.0]}
    lines = bench.format_paged_table({256: t}).splitlines()
    assert "contiguous ms" in lines[0] and "paged/contig" in lines[0]
    # median (first quartile-third quartile), quartiles of three values a <= b <= c: (a+b)/2 and (b+c)/2
    assert lines[1].split() == ["256", "2.000", "(1.500-2.500)", "4.000", "(3.000-6.500)", "2.00x", "(2.00-2.50)"]


def test_copy_bandwidth_is_positive():
    assert bench.copy_bandwidth(n_bytes=4 * 2**20, repeats=2) > 1e6  # more than a megabyte per second


def test_quantized_decode_cost_times_both_caches_on_the_same_text():
    """Both caches are timed per step in every repeat and fed the same tokens; a bad format is refused first."""
    model = small_model(head_dim=16)
    runs = bench.quantized_decode_cost(model, 12, "nvfp4", new_tokens=3, repeats=2)
    assert list(runs) == ["full precision", "nvfp4"]
    for run in runs.values():
        assert len(run["seconds"]) == 2 and all(s > 0 for s in run["seconds"])
    assert torch.equal(runs["full precision"]["tokens"], runs["nvfp4"]["tokens"])
    assert runs["nvfp4"]["tokens"].shape == (1, 3)
    assert "nvfp4" in bench.format_decode_comparison(runs, baseline="full precision")
    with pytest.raises(ValueError, match="fmt"):
        bench.quantized_decode_cost(model, 12, "int3")


def test_lesson11_benchmarks_on_a_tiny_model():
    """The engine sweep, the chunked-prefill runs and the speculative runs: every round kept, tokens counted."""
    from conftest import random_ids, small_model
    from kvlessons.bench import (
        chunked_prefill_times, engine_batch_times, format_chunked_prefill_times, format_engine_batch_times,
        format_speculative_times, speculative_times,
    )
    from kvlessons.serving import PromptLookupDraft

    model = small_model(vocab_size=64, head_dim=16)
    requests = [dict(prompt=random_ids(1, 5 + i, vocab=64, seed=i), new_tokens=4, arrival=i) for i in range(4)]
    sweep = engine_batch_times(model, requests, batch_limits=(1, 4), repeats=2, block_size=4, num_blocks=64)
    assert all(len(o["seconds"]) == 2 and o["tokens"] == 16 for o in sweep.values())
    assert max(sweep[4]["step"]) > 1 and max(sweep[1]["step"]) == 1  # batch 1 never decodes two at once
    assert "batch limit 4" in format_engine_batch_times(sweep)
    long = dict(prompt=random_ids(1, 30, vocab=64, seed=9), new_tokens=2, arrival=2)
    chunked = chunked_prefill_times(model, requests[:2], long, budgets=(None, 8), repeats=1, block_size=4)
    assert set(chunked) == {None, 8} and all(len(o["long_ttft"]) == 1 for o in chunked.values())
    assert "whole prompt" in format_chunked_prefill_times(chunked)
    spec = speculative_times(model, {"lookup": PromptLookupDraft}, random_ids(1, 8, vocab=64), 10, ks=(1, 3), repeats=1)
    assert all(spec[("lookup", k)]["tokens"] == spec["greedy"]["tokens"] for k in (1, 3))
    table = format_speculative_times(spec)
    assert "NO" not in table and table.count("lookup") == 2

import pytest

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


def test_decode_time_leaves_cache_state_repeatable():
    """decode_time crops the cache back, so every repeat times the same step (runs without error for static)."""
    assert bench.decode_time(small_model(), 5, "static", repeats=3) > 0


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


def test_paged_decode_time_reports_both_and_the_ratio():
    t = bench.paged_decode_time(64, block_size=8, repeats=2)
    assert t["contiguous"] > 0 and t["paged"] > 0
    assert t["ratio"] == pytest.approx(t["paged"] / t["contiguous"])


def test_copy_bandwidth_is_positive():
    assert bench.copy_bandwidth(n_bytes=4 * 2**20, repeats=2) > 1e6  # more than a megabyte per second

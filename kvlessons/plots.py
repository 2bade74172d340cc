"""Matplotlib figures for the lessons. They draw what other modules computed; they compute nothing."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter


def plot_kv_work(work: dict):
    """Counted K/V token-positions against tokens generated, from :func:`kvlessons.generate.measure_kv_work`."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(work["n"], work["recompute"], "o-", label="recompute every step")
    ax.plot(work["n"], work["cached"], "s-", label="with a KV cache")
    ax.set_xlabel("tokens generated, n")
    ax.set_ylabel("K/V token-positions computed")
    ax.set_title("Work to write n tokens: n(n+1)/2 against n")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_mask(mask, title: str = "", ax=None):
    """Draw a bool attention mask (queries down, keys across); True cells filled."""
    if ax is None:
        _, ax = plt.subplots(figsize=(0.45 * mask.shape[1] + 1, 0.45 * mask.shape[0] + 1))
    m = mask.detach().cpu().int().numpy()
    ax.imshow(m, cmap="Blues", vmin=0, vmax=1.4)
    q_len, kv_len = m.shape
    ax.set_xticks(range(kv_len))
    ax.set_yticks(range(q_len), labels=[str(kv_len - q_len + i) for i in range(q_len)])
    # thin white lines between cells so each query/key pair reads as one square
    ax.set_xticks([x - 0.5 for x in range(1, kv_len)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, q_len)], minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_title(title)
    return ax


def _context_axis(ax, lengths):
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, labels=[f"{n // 1024}K" if n >= 1024 else str(n) for n in lengths])
    ax.set_xlabel("context length (tokens)")
    ax.grid(alpha=0.3, which="both")


def plot_cache_vs_context(curves: dict, lengths, title="KV cache of one sequence (bf16)"):
    """Cache GiB against context for each model: ``curves`` maps name -> bytes at each length."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, sizes in curves.items():
        ax.plot(lengths, [b / 2**30 for b in sizes], "o-", ms=3, label=name)
    _context_axis(ax, lengths)
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_ylabel("GiB (log scale)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_concurrency_vs_context(curves: dict, lengths, budget_label: str):
    """Concurrent sequences that fit against context: ``curves`` maps name -> count at each length."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, counts in curves.items():
        ax.plot(lengths, counts, "o-", ms=3, label=name)
    _context_axis(ax, lengths)
    ax.set_yscale("symlog", base=2, linthresh=1)  # symlog: 0 sequences is a real answer, log cannot show it
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_ylabel("sequences that fit (log scale)")
    ax.set_title(f"Long context changes the concurrency math ({budget_label} of cache)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_bytes_per_token(table: dict, title: str):
    """Grouped bars: ``table`` maps variant -> {dtype: bytes per token}; log scale, values labelled."""
    import numpy as np

    names = list(table)
    dtypes = list(next(iter(table.values())))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(dtypes)
    x = np.arange(len(names))
    for j, dt in enumerate(dtypes):
        values = [table[n][dt] / 1024 for n in names]
        bars = ax.bar(x + (j - (len(dtypes) - 1) / 2) * width, values, width, label=dt)
        ax.bar_label(bars, labels=[f"{v:g}" for v in values], fontsize=6, rotation=90, padding=2)
    ax.set_xticks(x, labels=names, rotation=15, fontsize=8)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_ylabel("KiB per token (log scale)")
    ax.set_title(title)
    ax.legend(title="storage")
    ax.margins(y=0.25)
    fig.tight_layout()
    return fig


def plot_head_sizes(sizes: dict):
    """Bars of measured cache bytes per head layout: ``sizes`` maps label -> bytes."""
    fig, ax = plt.subplots(figsize=(5, 3))
    bars = ax.bar(list(sizes), list(sizes.values()), color=["#4e79a7", "#f28e2b", "#59a14f"][: len(sizes)])
    ax.bar_label(bars, labels=[f"{v:,} B" for v in sizes.values()], fontsize=8)
    ax.set_ylabel("cache bytes (measured)")
    ax.set_title("Same model, fewer KV heads")
    ax.margins(y=0.15)
    fig.tight_layout()
    return fig


def plot_e2m1_grid(values, midpoints):
    """The E2M1 magnitudes on a number line (both signs), with the rounding boundaries between them."""
    fig, ax = plt.subplots(figsize=(9, 1.8))
    pts = sorted({-v for v in values} | set(values))
    ax.axhline(0, color="#999", lw=1)
    ax.plot(pts, [0] * len(pts), "o", color="#4e79a7", ms=8, zorder=3)
    for m in midpoints:
        for x in (m, -m):
            ax.axvline(x, color="#e15759", lw=0.8, ls=":", ymin=0.3, ymax=0.7)
    for v in pts:
        ax.annotate(f"{v:g}", (v, 0), textcoords="offset points", xytext=(0, 9), ha="center", fontsize=8)
    ax.set_yticks([])
    ax.set_xlim(-6.6, 6.6)
    ax.set_title("E2M1: the 15 distinct values (dots) and the rounding boundaries between them (dotted)")
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def plot_simulation(results: dict):
    """Three panels over time for each simulated policy: slots held vs used, running sequences, fragmentation."""
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for (name, r), colour in zip(results.items(), ["#e15759", "#f28e2b", "#4e79a7", "#59a14f"]):
        steps = range(len(r.held))
        axes[0].plot(steps, [h / r.capacity for h in r.held], color=colour, lw=1, label=f"{name}: held")
        axes[0].plot(steps, [u / r.capacity for u in r.used], color=colour, lw=1, ls=":", label=f"{name}: used")
        axes[1].plot(steps, r.running, color=colour, lw=1, label=name)
        axes[2].plot(steps, r.fragmentation(), color=colour, lw=1, label=name)
    axes[0].set_ylabel("share of the budget")
    axes[0].set_title("slots held (solid) and used (dotted)")
    axes[1].set_title("sequences running")
    axes[2].set_title("free slots outside the largest free run")
    for ax in axes:
        ax.set_xlabel("step (prefill chunks and decode tokens)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    return fig


def _log_log(fig, ax, xlabel: str, ylabel: str, title: str):
    """Finish a figure whose y axis (and x axis, set by the caller) is logarithmic."""
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


def plot_intensity(grid: dict, batches, ridges: dict | None = None, title: str = ""):
    """Counted FLOPs per byte against batch size, one line per context (:func:`kvlessons.roofline.intensity_grid`);
    ``ridges`` ({label: FLOPs per byte}) draws machines' ridge points as horizontal lines."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for context, values in grid.items():
        ax.plot(batches, values, "o-", label=f"context {context:,}")
    for label, ridge in (ridges or {}).items():
        ax.axhline(ridge, ls="--", lw=1, color="gray")
        ax.text(batches[0], ridge * 1.08, label, fontsize=8, color="gray")
    ax.set_xscale("log", base=2)
    return _log_log(fig, ax, "batch (sequences decoded together)", "FLOPs per byte read", title)


def plot_roofline(ceilings, points, title: str = ""):
    """This machine's roofline per dtype (measured ceilings) with the measured decode steps on it.

    Each step is drawn at its counted intensity and its *achieved* FLOP/s (counted
    FLOPs / measured seconds), with a bar over its quartiles; the ceiling above it is
    the best the roofline allows. ``ceilings`` and ``points`` come from
    :func:`kvlessons.roofline.measure_ceilings` and :func:`~kvlessons.roofline.measure_decode_steps`.
    """
    import numpy as np

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    intensities = [p.cost.intensity for p in points]
    x = np.geomspace(min(intensities) / 2, max(intensities + [max(ceilings.ridge(d) for d in ceilings.flops)]) * 2, 200)
    bw = ceilings.bandwidth.median
    markers = ["o", "s", "^", "D"]  # one per context
    contexts = sorted({p.context for p in points})
    for i, dtype in enumerate(ceilings.flops):
        color = f"C{i}"
        peak = ceilings.flops[dtype].median
        # The rooflines share their memory slope: draw them in different styles so both stay visible.
        ax.plot(x, np.minimum(bw * x, peak) / 1e9, color=color, lw=1.5, ls=("-", "--", ":")[i % 3],
                label=f"{dtype} roofline; points in this colour: {dtype} steps")
        for p in points:
            if p.dtype != dtype:
                continue
            low, high = p.seconds.spread
            achieved = p.cost.flops / p.seconds.median / 1e9
            err = [[achieved - p.cost.flops / high / 1e9], [p.cost.flops / low / 1e9 - achieved]]
            m = markers[contexts.index(p.context) % 4]
            ax.errorbar(p.cost.intensity, achieved, yerr=err, fmt=m, color=color, ms=5, capsize=2)
            below = contexts.index(p.context) % 2  # the two contexts' labels on opposite sides of their points
            ax.annotate(str(p.batch), (p.cost.intensity, achieved), textcoords="offset points",
                        xytext=(5, -11) if below else (-9, 5), fontsize=7, color=color)
    for j, c in enumerate(contexts):
        ax.plot([], [], markers[j % 4], color="gray", label=f"measured, context {c} (label: batch)")
    ax.set_xscale("log")
    return _log_log(fig, ax, "arithmetic intensity (FLOPs per byte read)", "GFLOP/s achieved", title)


def plot_append_cost(medians: dict, lengths, title: str = ""):
    """Microseconds per append against cache length: ``medians[row label][side]`` holds one (median, first quartile,
    third quartile) per length (lesson 07: ``torch.cat`` against a preallocated cache, from ``pitfalls.append_cost``).
    One line style per row size, one colour per side, the quartiles as error bars."""
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"torch.cat": "C3", "preallocated": "C0"}
    for (label, sides), (marker, ls) in zip(medians.items(), (("o", "-"), ("s", "--"), ("^", ":"))):
        for side, values in sides.items():
            mid, q1, q3 = zip(*values)
            ax.errorbar(lengths, mid, yerr=[[m - a for m, a in zip(mid, q1)], [b - m for m, b in zip(mid, q3)]],
                        marker=marker, ls=ls, color=colors.get(side), ms=4, capsize=2, label=f"{side}, {label}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, labels=[str(n) for n in lengths])
    ax.set_yscale("log")
    ax.set_xlabel("tokens in the cache after the appends")
    ax.set_ylabel("µs per append (median, quartiles)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, handlelength=3)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


def plot_quality_sweep(sweep: dict, title: str = ""):
    """Top-1 agreement with the full cache against the fraction of the prompt kept, one line per policy (lesson 10)."""
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name, rows in sweep.items():
        ax.plot([r["fraction"] for r in rows], [r["top1"] for r in rows], marker="o", label=name)
    ax.set_xlabel("fraction of the prompt's positions kept (per KV head)")
    ax.set_ylabel("next-token agreement with the full cache")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title(title or "Quality against kept fraction")
    fig.tight_layout()
    return fig


def plot_batch_layout(layout, names=None, title: str = ""):
    """One batched step's mask (lesson 11): new tokens down, gathered pool slots across, each sequence in its colour.

    ``layout`` is a :class:`kvlessons.serving.engine.BatchLayout`. A cell is coloured where
    the token may attend; grey columns are slots of another sequence's blocks (masked),
    white ones the unused tail of a last block.
    """
    import numpy as np

    mask = layout.mask.cpu().numpy()
    q_seq, k_seq = layout.query_seq.cpu().numpy(), layout.key_seq.cpu().numpy()
    colours = np.array([[0.31, 0.47, 0.65], [0.95, 0.56, 0.17], [0.35, 0.63, 0.31], [0.88, 0.34, 0.35],
                        [0.69, 0.48, 0.63], [0.46, 0.72, 0.70]])
    image = np.ones(mask.shape + (3,))
    image[q_seq[:, None] != k_seq[None, :]] = 0.88  # another sequence's slot
    image[mask] = colours[q_seq % len(colours)][:, None, :].repeat(mask.shape[1], 1)[mask]
    fig, ax = plt.subplots(figsize=(min(12, 0.16 * mask.shape[1] + 2), 0.22 * mask.shape[0] + 1.4))
    ax.imshow(image, aspect="auto", interpolation="nearest")
    bounds = np.flatnonzero(np.diff(k_seq)) + 0.5
    for x in bounds:
        ax.axvline(x, color="black", lw=0.8)
    for y in np.flatnonzero(np.diff(q_seq)) + 0.5:
        ax.axhline(y, color="black", lw=0.8)
    names = names or [f"seq {j}" for j in range(int(q_seq.max()) + 1)]
    starts = [0, *(int(b + 0.5) for b in np.flatnonzero(np.diff(q_seq)) + 1)]
    ax.set_yticks(starts, labels=[f"{names[q_seq[s]]}, pos {int(layout.positions[s])}" for s in starts], fontsize=7)
    ax.set_xlabel("gathered pool slots (every block of every sequence's table, in order)")
    ax.set_ylabel("new tokens (packed)")
    ax.set_title(title or "One batched step: who may attend to what")
    fig.tight_layout()
    return fig


def plot_engine_timeline(steps, num_blocks: int, title: str = ""):
    """Requests running and waiting, and the pool's free blocks, step by step (lesson 11's engine)."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.2))
    xs = [s.step for s in steps]
    ax.step(xs, [s.running for s in steps], where="post", label="running")
    ax.step(xs, [s.waiting for s in steps], where="post", label="waiting or not arrived")
    for s in steps:
        if s.finished:
            ax.axvline(s.step, color="grey", lw=0.6, ls=":")
    ax.set_xlabel("engine step")
    ax.set_ylabel("requests")
    ax.set_title("the batch: dotted lines where a request finished")
    ax.legend(fontsize=8)
    bx.step(xs, [s.free_blocks for s in steps], where="post", label="free")
    bx.step(xs, [s.kept_blocks for s in steps], where="post", label="kept for prefix reuse")
    bx.axhline(num_blocks, color="black", lw=0.8, ls="--", label="pool")
    bx.set_xlabel("engine step")
    bx.set_ylabel("blocks")
    bx.set_title("the pool after each step")
    bx.legend(fontsize=8)
    for a in (ax, bx):
        a.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_batch_throughput(times: dict, title: str = ""):
    """Lesson 11: tokens per second against the batch limit (median, quartile bars), and a decode step's time by batch."""
    from .bench import decode_step_medians, median_and_quartiles

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.4))
    limits = list(times)
    rates = [[times[b]["tokens"] / s for s in times[b]["seconds"]] for b in limits]
    mids = [median_and_quartiles(r) for r in rates]
    ax.errorbar(limits, [m for m, _, _ in mids], yerr=[[m - lo for m, lo, _ in mids], [hi - m for m, _, hi in mids]],
                marker="o", capsize=3)
    ax.set_xscale("log", base=2)
    ax.set_xticks(limits, labels=[str(b) for b in limits])
    ax.set_xlabel("batch limit (max_num_seqs)")
    ax.set_ylabel("generated tokens per second")
    ax.set_title("throughput, median and quartiles")
    steps = decode_step_medians(times)
    bx.plot(list(steps), [s * 1e3 for s in steps.values()], marker="o")
    bx.set_ylim(bottom=0)
    bx.set_xlabel("sequences in the decode step")
    bx.set_ylabel("ms per step (median)")
    bx.set_title("one decode step: the weights are read once for all")
    for a in (ax, bx):
        a.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig

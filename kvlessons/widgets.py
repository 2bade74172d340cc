"""Interactive views for the lessons (01, 02, 03, 06, 07). They display what other modules computed.

Every widget follows one pattern: a pure ``*_html`` function renders one state (so the
lesson reads, and CI checks it, without a browser), and the widget writes that HTML
into one ``ipywidgets.HTML`` view on every change. The view's ``value`` is the
displayed result, which unit tests read after moving a slider.
"""

from __future__ import annotations

import html

import torch

from IPython.display import HTML, display

from .generate import TraceStep
from .memory import (
    DTYPES, PRESETS, Estimate, estimate, format_bytes, kv_bytes_per_token, kv_cache_bytes, layer_bytes_per_token,
    storage_format,
)

_BOX = "display:inline-block;min-width:1.6em;padding:2px 4px;margin:1px;border-radius:3px;text-align:center;font-family:monospace;"
_PROMPT = "background:#cfe2ff;border:1px solid #6c9bd2;"
_GENERATED = "background:#d1f0d6;border:1px solid #5cae6b;"
_NEXT = "background:#fff;border:1px dashed #999;color:#555;"


def _label(text: str) -> str:
    return f'<span style="display:inline-block;width:6em;font-family:monospace">{html.escape(text)}</span>'


def cache_step_html(trace: list[TraceStep], step: int, tokenizer, layers: int, prompt_len: int) -> str:
    """HTML for one step of a traced generation: the context, the cache grid, the next-token odds."""
    if not 0 <= step < len(trace):
        raise ValueError(f"step must be in [0, {len(trace)}), got {step}")
    s = trace[step]

    def box(tok: int, style: str) -> str:
        return f'<span style="{_BOX}{style}">{html.escape(tokenizer.token_str(tok))}</span>'

    context = "".join(box(t, _PROMPT if i < prompt_len else _GENERATED) for i, t in enumerate(s.tokens))
    context += box(s.next_token, _NEXT)
    legend = (
        f'<span style="{_BOX}{_PROMPT}">prompt</span> read in one pass (prefill) '
        f'<span style="{_BOX}{_GENERATED}">generated</span> one per decode step '
        f'<span style="{_BOX}{_NEXT}">next</span> chosen now, cached on the next step'
    )
    rows = []
    for layer in range(layers):
        for kind in ("K", "V"):
            cells = "".join(
                f'<span data-kind="{kind}" style="{_BOX}{_PROMPT if i < prompt_len else _GENERATED}">{kind}</span>'
                for i in range(s.cached_tokens)
            )
            rows.append(f"<div>{_label(f'layer {layer} {kind}')}{cells}</div>")
    odds = ", ".join(
        f"{html.escape(repr(tokenizer.decode([t])))} {p:.0%}" for t, p in zip(s.top_tokens, s.top_probs)
    )
    phase = "after prefill (the prompt read in one pass)" if step == 0 else f"after decode step {step}"
    return (
        f"<div><b>Step {step}</b>, {phase}: {s.cached_tokens} tokens cached, "
        f"cache = {format_bytes(s.cache_bytes)} ({s.cache_bytes:,} bytes)</div>"
        f"<div style='margin:6px 0'>{_label('context')}{context}</div>"
        f"<div>{''.join(rows)}</div>"
        f"<div style='margin-top:6px'>next token (greedy): {html.escape(repr(tokenizer.decode([s.next_token])))}; "
        f"most likely: {odds}</div>"
        f"<div style='margin-top:6px;font-size:85%;color:#444'>{legend}</div>"
    )


def describe_cache_step(trace: list[TraceStep], step: int) -> str:
    """One line of text for a traced step: tokens cached and bytes held."""
    s = trace[step]
    return f"step {step}: {s.cached_tokens} tokens cached, {s.cache_bytes:,} bytes"


def show_cache_step(trace, step, tokenizer, layers, prompt_len) -> None:
    """Display :func:`cache_step_html` for one step (the browser-free view of the widget)."""
    display(HTML(cache_step_html(trace, step, tokenizer, layers, prompt_len)))


def stepper_widget(n_steps: int, render_html, interval_ms: int = 700):
    """A play button linked to a step slider over ``n_steps`` states; ``render_html(step)`` draws one."""
    import ipywidgets as w

    play = w.Play(value=0, min=0, max=n_steps - 1, step=1, interval=interval_ms, description="play")
    slider = w.IntSlider(value=0, min=0, max=n_steps - 1, description="step")
    w.jslink((play, "value"), (slider, "value"))
    view = w.HTML()

    def render(change=None):
        view.value = render_html(slider.value)

    slider.observe(render, names="value")
    render()
    box = w.VBox([w.HBox([play, slider]), view])
    box.slider, box.view = slider, view  # handles for tests
    return box


def cache_growth_widget(trace, tokenizer, layers: int, prompt_len: int, interval_ms: int = 700):
    """A play button and a step slider over a traced generation; returns the widget box."""
    return stepper_widget(len(trace), lambda step: cache_step_html(trace, step, tokenizer, layers, prompt_len), interval_ms)


# --- the memory estimator (lesson 02) ----------------------------------------------------------

ESTIMATOR_RANGES = {
    "layers": (8, 96, 1),
    "kv_heads": (1, 64, 1),
    "head_dim": (32, 256, 32),  # multiples of 32: whole scale groups for every 4-bit format
    "seq_len": (512, 131072, 512),  # up to 128K, the longest context in the presets' table
    "batch": (1, 64, 1),
}
ESTIMATOR_DEFAULTS = {"layers": 32, "kv_heads": 8, "head_dim": 128, "seq_len": 4096, "batch": 8, "dtype": "bf16"}


def _count(n: int, word: str) -> str:
    """'1 sequence', '8 sequences'."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _breakdown_html(title: str, total: int, per_token_per_layer: int, per_token: int, per_sequence: int,
                    seq_len: int, batch: int, dtype: str, formula: str) -> str:
    rows = [
        ("Per token, per layer", per_token_per_layer),
        ("Per token, all layers", per_token),
        ("One full sequence", per_sequence),
    ]
    cells = "".join(
        f"<tr><td style='padding:2px 12px 2px 0'>{label}</td><td style='text-align:right'><b>{format_bytes(v)}</b></td></tr>"
        for label, v in rows
    )
    return (
        f"<div style='font-size:110%'>{title}: <b>{format_bytes(total)}</b> "
        f"for {_count(batch, 'sequence')} of {_count(seq_len, 'token')} in {dtype}</div>"
        f"<table style='margin:6px 0'>{cells}</table>"
        f"<div style='font-family:monospace'>{html.escape(formula)}</div>"
    )


def _latent_html(p, seq_len: int, batch: int, dtype: str) -> str:
    """A latent-cache (MLA) preset: its own figure, since K/V heads and head dim do not describe what it stores."""
    shape = p.shape
    total = kv_cache_bytes(shape, seq_len, batch, dtype)
    per_value = f"{float(storage_format(dtype).bits_per_value / 8):g} B"
    layers = len(shape.cache_layers)
    formula = (f"{_count(layers, 'layer')} · {shape.latent_dim} latent values · {seq_len:,} tokens · "
               f"{batch} seq · {per_value} = {total:,} B = {format_bytes(total)}")
    note = (f"<div style='margin-top:6px;color:#7a4b00'>{html.escape(p.name)}: {html.escape(p.note)}; "
            f"so the KV heads and head dim sliders do not apply (greyed out). Move the layers slider to leave "
            f"the preset.</div>")
    return _breakdown_html(
        f"Estimated KV cache ({html.escape(p.name)}, MLA latents)", total, layer_bytes_per_token(shape, 0, dtype),
        kv_bytes_per_token(shape, dtype), kv_cache_bytes(shape, seq_len, 1, dtype), seq_len, batch, dtype, formula,
    ) + note


def estimate_html(est: Estimate, preset_name: str | None = None) -> str:
    """HTML for one estimate: the total, the per-token/per-layer/per-sequence breakdown, the formula.

    With ``preset_name`` whose shape has windows, the preset's exact figure is shown too,
    since the uniform formula overstates it. A preset with a latent cache (MLA) is shown
    as what it stores, one latent row per layer per token: its KV heads and head dim do
    not enter, so ``est``'s are ignored and only its length, batch and precision count.
    """
    p = PRESETS[preset_name] if preset_name is not None else None
    if p is not None and p.shape.latent_dim is not None:
        return _latent_html(p, est.seq_len, est.batch, est.dtype)
    page = _breakdown_html("Estimated KV cache", est.total, est.per_token_per_layer, est.per_token, est.per_sequence,
                           est.seq_len, est.batch, est.dtype, est.formula)
    if p is not None:
        exact = kv_cache_bytes(p.shape, est.seq_len, est.batch, est.dtype)
        if exact != est.total:
            page += (
                f"<div style='margin-top:6px;color:#7a4b00'>{html.escape(p.name)} exactly: <b>{format_bytes(exact)}</b> "
                f"({html.escape(p.note)})</div>"
            )
    return page


def _preset_slider_values(name: str) -> dict:
    """The slider values a preset sets: layers, KV heads and head dim; layers only for a latent (MLA) cache."""
    s = PRESETS[name].shape
    if s.latent_dim is not None:
        return {"layers": s.layers}
    return {"layers": s.layers, "kv_heads": s.kv_heads, "head_dim": s.head_dim}


def memory_estimator_widget():
    """Sliders for layers, KV heads, head dim, context and sequences, a precision and a preset selector.

    Every reachable combination is valid (ranges and steps are chosen so), so the
    widget cannot be driven into an exception. A latent-cache preset (MLA) greys out
    the KV heads and head dim sliders, which do not describe its cache. Returns the widget box.
    """
    import ipywidgets as w

    sliders = {
        key: w.IntSlider(value=ESTIMATOR_DEFAULTS[key], min=lo, max=hi, step=step, description=key,
                         continuous_update=True, style={"description_width": "70px"})
        for key, (lo, hi, step) in ESTIMATOR_RANGES.items()
    }
    dtype = w.Dropdown(options=list(DTYPES), value=ESTIMATOR_DEFAULTS["dtype"], description="precision")
    presets = w.Dropdown(options=["custom"] + list(PRESETS), value="custom", description="preset")
    view = w.HTML()
    state = {"preset": None, "loading": False}

    def current() -> Estimate:
        return estimate(
            sliders["layers"].value, sliders["kv_heads"].value, sliders["head_dim"].value,
            sliders["seq_len"].value, sliders["batch"].value, dtype.value,
        )

    def render(change=None):
        if state["loading"]:
            return
        if state["preset"] is not None:
            wanted = _preset_slider_values(state["preset"])
            if wanted != {k: sliders[k].value for k in wanted}:
                state["preset"] = None  # a shape slider moved: no longer the preset
                presets.value = "custom"
        latent = state["preset"] is not None and PRESETS[state["preset"]].shape.latent_dim is not None
        for key in ("kv_heads", "head_dim"):
            sliders[key].disabled = latent
        view.value = estimate_html(current(), state["preset"])

    def load_preset(change):
        if change["new"] == "custom":
            state["preset"] = None
            render()
            return
        state["loading"] = True
        for key, v in _preset_slider_values(change["new"]).items():
            sliders[key].value = v
        state["loading"] = False
        state["preset"] = change["new"]
        render()

    for s in sliders.values():
        s.observe(render, names="value")
    dtype.observe(render, names="value")
    presets.observe(load_preset, names="value")
    render()
    box = w.VBox([presets, *sliders.values(), dtype, view])
    box.sliders, box.dtype, box.presets, box.view = sliders, dtype, presets, view  # handles for tests
    return box


# --- which query heads read which KV head (lesson 03) -------------------------------------------

_HEAD_COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"]


def head_groups_html(q_heads: int, kv_heads: int) -> str:
    """HTML picture: one row of query heads, one of KV heads, each query coloured like the KV head it reads."""
    from .gqa import query_groups

    groups = query_groups(q_heads, kv_heads)  # validates
    colour = {q: _HEAD_COLOURS[j % len(_HEAD_COLOURS)] for j, qs in enumerate(groups) for q in qs}
    cell = "display:inline-block;width:2.4em;margin:1px;padding:3px 0;text-align:center;border-radius:3px;color:white;font-family:monospace;"
    q_row = "".join(f'<span data-q="{q}" style="{cell}background:{colour[q]}">q{q}</span>' for q in range(q_heads))
    kv_row = "".join(
        f'<span data-kv="{j}" style="{cell}background:{_HEAD_COLOURS[j % len(_HEAD_COLOURS)]};'
        f'width:{2.4 * len(qs) + 0.15 * (len(qs) - 1):.2f}em">kv{j}</span>'
        for j, qs in enumerate(groups)
    )
    kind = "MHA" if kv_heads == q_heads else "MQA" if kv_heads == 1 else "GQA"
    g = q_heads // kv_heads
    return (
        f"<div><b>{kind}</b>: {q_heads} query heads, {kv_heads} KV heads, {g} quer{'y' if g == 1 else 'ies'} per KV head; "
        f"cache {q_heads // kv_heads}x smaller than MHA</div>"
        f"<div style='margin-top:4px'>{q_row}</div><div>{kv_row}</div>"
    )


def head_groups_widget(q_heads: int = 8, kv_heads: int = 2):
    """Pick query heads and a divisor of them as KV heads; see who reads what. Cannot raise."""
    import ipywidgets as w

    def divisors(n):
        return [d for d in range(1, n + 1) if n % d == 0]

    q = w.IntSlider(value=q_heads, min=1, max=32, description="q_heads")
    kv = w.Dropdown(options=divisors(q_heads), value=kv_heads, description="kv_heads")
    view = w.HTML()

    def render(change=None):
        view.value = head_groups_html(q.value, kv.value)

    def new_q(change):
        old = kv.value
        options = divisors(q.value)
        # Keep the choice if it still divides; else the largest divisor below it (never invalid).
        kv.unobserve(render, names="value")
        kv.options = options
        kv.value = old if old in options else max(d for d in options if d <= old)
        kv.observe(render, names="value")
        render()

    q.observe(new_q, names="value")
    kv.observe(render, names="value")
    return _two_controls(render, q, kv, view, ("q_heads", "kv_heads"))


# --- block tables (lesson 06) ------------------------------------------------------------------

_OWNER_COLOURS = {"A": "#4e79a7", "B": "#f28e2b", "C": "#59a14f", "D": "#b07aa1", "E": "#e15759", "F": "#76b7b2"}


def block_table_html(snapshot: dict) -> str:
    """One snapshot of :func:`kvlessons.paging.block_scenario`: the pool coloured by owner, and every table."""
    owners: dict[int, list[str]] = {}
    fill: dict[int, int] = {}
    bs = snapshot["block_size"]
    for name, seq in snapshot["sequences"].items():
        for i, b in enumerate(seq["table"]):
            owners.setdefault(b, []).append(name)
            fill[b] = max(fill.get(b, 0), min(bs, max(0, seq["length"] - i * bs)))
    cells = []
    for b in range(snapshot["num_blocks"]):
        names = owners.get(b, [])
        if not names:
            style, label = "background:#f2f2f2;color:#999;border:1px dashed #bbb;", "free"
        elif len(names) == 1:
            style, label = f"background:{_OWNER_COLOURS.get(names[0], '#888')};color:white;border:1px solid #333;", names[0]
        else:
            colours = [_OWNER_COLOURS.get(n, "#888") for n in names]
            stops = ",".join(f"{c} {i * 100 // len(colours)}% {(i + 1) * 100 // len(colours)}%" for i, c in enumerate(colours))
            style = f"background:linear-gradient(90deg,{stops});color:white;border:2px solid #000;"
            label = "+".join(names) + f" (x{snapshot['ref_counts'][b]})"
        slots = f"{fill.get(b, 0)}/{bs}" if names else ""
        cells.append(
            f'<div data-block="{b}" data-owners="{"+".join(names)}" style="display:inline-block;width:8.6em;margin:2px;'
            f'padding:3px;border-radius:4px;font-family:monospace;font-size:85%;text-align:center;{style}">'
            f"#{b} {html.escape(label)}<br>{slots}</div>"
        )
    rows = "".join(
        f"<tr><td style='padding-right:10px'><b>{html.escape(n)}</b></td><td>{s['length']} tokens</td>"
        f"<td style='padding-left:10px;font-family:monospace'>{s['table']}</td></tr>"
        for n, s in snapshot["sequences"].items()
    )
    held, used = snapshot["held"], snapshot["used"]
    waste = f"{(held - used) / held:.0%}" if held else "0%"
    return (
        f"<div><b>{html.escape(snapshot['event'])}</b></div>"
        f"<div style='margin:6px 0'>{''.join(cells)}</div>"
        f"<table><tr><th align=left>seq</th><th align=left>length</th><th align=left>block table</th></tr>{rows}</table>"
        f"<div style='margin-top:4px'>slots used {used} of {held} held ({waste} waste); "
        f"{snapshot['ref_counts'].count(0)} of {snapshot['num_blocks']} blocks free</div>"
    )


def block_table_widget(snapshots: list[dict], interval_ms: int = 1200):
    """Step through a block-table scenario with play and a slider."""
    return stepper_widget(len(snapshots), lambda step: block_table_html(snapshots[step]), interval_ms)


# --- mask explorer (lesson 07) -----------------------------------------------------------------


def mask_grid_html(mask, title: str) -> str:
    """A bool mask (queries down, keys across) as an HTML grid; rows labelled by absolute position."""
    q_len, kv_len = mask.shape
    head = "".join(f"<th style='font-weight:normal;font-size:75%;width:1.4em'>{j}</th>" for j in range(kv_len))
    rows = []
    for i in range(q_len):
        cells = "".join(
            f"<td data-on='{int(mask[i, j])}' style='width:1.4em;height:1.4em;border:1px solid #fff;"
            f"background:{'#4e79a7' if mask[i, j] else '#e8e8e8'}'></td>"
            for j in range(kv_len)
        )
        rows.append(f"<tr><th style='font-weight:normal;font-size:75%;padding-right:4px'>{kv_len - q_len + i}</th>{cells}</tr>")
    return (f"<div style='display:inline-block;vertical-align:top;margin-right:24px'><div><b>{html.escape(title)}</b></div>"
            f"<table style='border-collapse:collapse'><tr><th></th>{head}</tr>{''.join(rows)}</table></div>")


def mask_explorer_html(q_len: int, kv_len: int) -> str:
    """Top-left (is_causal=True) and bottom-right (correct with a cache) masks side by side, with a verdict."""
    import torch

    from .attention import causal_mask

    right = causal_mask(q_len, kv_len)
    top_left = causal_mask(q_len, kv_len, align="top_left")
    same = torch.equal(right, top_left)
    verdict = ("identical: with no cache (q_len == kv_len) both alignments agree" if same else
               f"different: is_causal=True hides {int((right & ~top_left).sum())} key(s) the queries are entitled to see")
    return (mask_grid_html(top_left, "top-left: is_causal=True") + mask_grid_html(right, "bottom-right: causal_mask")
            + f"<div style='margin-top:6px'>{q_len} new queries over {kv_len} keys: {verdict}</div>")


def mask_explorer_widget(q_len: int = 3, kv_len: int = 8):
    """Sliders for new queries and total keys (q_len <= kv_len always); both alignments drawn."""
    import ipywidgets as w

    kv = w.IntSlider(value=kv_len, min=1, max=16, description="kv_len")
    q = w.IntSlider(value=min(q_len, kv_len), min=1, max=kv_len, description="q_len")
    view = w.HTML()

    def render(change=None):
        q.max = kv.value  # q_len can never exceed kv_len, so no state is invalid
        view.value = mask_explorer_html(min(q.value, kv.value), kv.value)

    kv.observe(render, names="value")
    q.observe(render, names="value")
    return _two_controls(render, q, kv, view, ("q_len", "kv_len"))


def _two_controls(render, first, second, view, names):
    """Draw once; return two controls side by side above ``view``, reachable as ``names`` (and ``view``) for tests."""
    import ipywidgets as w

    render()
    box = w.VBox([w.HBox([first, second]), view])
    setattr(box, names[0], first)
    setattr(box, names[1], second)
    box.view = view
    return box


# --- which tokens an eviction policy keeps (lesson 10) ---------------------------------------------------


def kept_tokens_html(tokens: list[str], kept: list[list[int]], title: str) -> str:
    """The prompt's tokens once per KV head: kept ones dark, evicted ones faint; ``kept[h]`` lists head h's positions."""
    rows = []
    for h, positions in enumerate(kept):
        keep = set(positions)
        cells = "".join(
            f'<span title="position {i}" style="padding:1px 2px;margin:1px;border-radius:3px;'
            + ("background:#2f5d8a;color:white;" if i in keep else "background:#eee;color:#aaa;")
            + f'">{html.escape(t) or "&nbsp;"}</span>'
            for i, t in enumerate(tokens))
        rows.append(f"<div style='margin:4px 0'><b>KV head {h}</b> keeps {len(keep)}:<br>{cells}</div>")
    return f"<div style='font-family:monospace;font-size:12px;line-height:1.9'><b>{html.escape(title)}</b>{''.join(rows)}</div>"


def eviction_explorer(model, tokenizer, ids, policies: dict, budgets=(8, 128, 8)):
    """Pick a policy, a budget and a layer: see which of the prompt's tokens each KV head keeps after the prompt.

    Each change runs the prompt through an EvictingCache (compress once, after the
    prompt) and reads the kept positions; the sliders are bounded, so no setting fails.
    """
    import ipywidgets as w

    from .eviction import EvictingCache

    tokens = [tokenizer.decode([t]) for t in ids[0].tolist()]
    lo, hi, step = budgets
    hi = max(1, min(hi, len(tokens)))  # a short prompt: the slider still has a valid range
    lo = min(lo, hi)
    policy = w.Dropdown(options=list(policies), description="policy")
    budget = w.IntSlider(value=min(32, hi), min=lo, max=hi, step=step, description="budget")
    layer = w.IntSlider(value=len(model.blocks) - 1, min=0, max=len(model.blocks) - 1, description="layer")
    view = w.HTML()

    def render(change=None):
        cache = EvictingCache(policies[policy.value], budget=budget.value)
        with torch.inference_mode():
            model(ids, cache=cache)
        kept = cache.kept_positions()[layer.value][0].tolist()
        view.value = kept_tokens_html(tokens, kept, f"{policy.value}, budget {budget.value} per KV head, layer {layer.value}")

    for control in (policy, budget, layer):
        control.observe(render, names="value")
    render()
    box = w.VBox([w.HBox([policy, budget, layer]), view])
    box.policy, box.budget, box.layer, box.view = policy, budget, layer, view
    return box

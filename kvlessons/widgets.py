"""Interactive views for the lessons. They display what other modules computed.

Every widget follows one pattern: a pure ``*_html`` / figure function renders one
state (so the lesson reads, and CI checks it, without a browser), and the widget
re-renders that function into one ``Output`` on every change via :func:`redraw`.
"""

from __future__ import annotations

import html

import matplotlib.pyplot as plt
from IPython.display import HTML, clear_output, display

from .generate import TraceStep
from .memory import format_bytes

_BOX = "display:inline-block;min-width:1.6em;padding:2px 4px;margin:1px;border-radius:3px;text-align:center;font-family:monospace;"
_PROMPT = "background:#cfe2ff;border:1px solid #6c9bd2;"
_GENERATED = "background:#d1f0d6;border:1px solid #5cae6b;"
_NEXT = "background:#fff;border:1px dashed #999;color:#555;"


def _label(text: str) -> str:
    return f'<span style="display:inline-block;width:6em;font-family:monospace">{html.escape(text)}</span>'


def redraw(output, render) -> None:
    """Replace what ``output`` shows with what ``render()`` displays; close replaced figures."""
    with output:
        clear_output(wait=True)
        plt.close("all")
        render()


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


def cache_growth_widget(trace, tokenizer, layers: int, prompt_len: int, interval_ms: int = 700):
    """A play button and a step slider over a traced generation; returns the widget box."""
    import ipywidgets as w

    play = w.Play(value=0, min=0, max=len(trace) - 1, step=1, interval=interval_ms, description="play")
    slider = w.IntSlider(value=0, min=0, max=len(trace) - 1, description="step")
    w.jslink((play, "value"), (slider, "value"))
    out = w.Output()

    def render(change=None):
        redraw(out, lambda: show_cache_step(trace, slider.value, tokenizer, layers, prompt_len))

    slider.observe(render, names="value")
    render()
    return w.VBox([w.HBox([play, slider]), out])

"""transformers' cache classes on SmolLM2, beside their kvlessons equivalents (lesson 11).

The knobs of the earlier lessons (grow or preallocate, a sliding window, quantized
storage with a full-precision tail, moving the cache off the accelerator, reusing a
prompt's cache) all exist in Hugging Face transformers, which is what learners will
use next. :func:`compare_hf_caches` runs each of its cache classes (4.57.1) and the
kvlessons cache that does the same job on the same weights and the same tokens, and
reports for each pair what it holds in bytes (measured from the tensors it keeps,
never from its own accounting) and how far the logits are apart.

How the logits are compared: the kvlessons side decodes greedily; transformers is fed
the same tokens (teacher forcing, positions given explicitly as ``cache_position``).
If every one of transformers' argmaxes equals the token kvlessons chose, a free-running
greedy generation on transformers' side would give exactly the same tokens (each
step would see the same inputs), so "same tokens" means what it says, and the logits
are always compared on identical inputs. Quantized caches are compared with their own
side's full-precision run instead (drift), since the two store different formats.

SmolLM2 is a Llama, and transformers' Llama has no sliding window (its mask is always
the full causal one), so the sliding-window rows load the very same weights into
transformers' Mistral (Llama's layout plus ``sliding_window``) and into a kvlessons
TinyDecoder with that window on every layer: both then compute windowed attention, and
the outputs differ from the full model's, as they should.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from ..cache import ConcatCache, StaticCache
from ..fp4 import QuantizedCache
from ..generate import generate
from ..memory import format_bytes
from ..memory.measured import held_tensors, storage_bytes
from ..model import TinyDecoder
from ..shape import require_positive_int

QUANT_BACKENDS = ("auto", "quanto", "hqq")  # transformers' two QuantizedCache backends; "auto": whichever is installed
QUANT_FORMATS = ("nvfp4", "fp8")  # kvlessons.fp4 formats offered as the quantized row's counterpart
QUANT_NBITS = 4  # transformers' default (and what nvfp4 stores per value)

# Where transformers 4.57.1 does what the notes below say (paths inside the installed transformers package).
_WHERE = {
    "sliding_keep": "cache_utils.py:203-211",
    "static_sliding": "cache_utils.py:409-421",
    "quantized_update": "cache_utils.py:527-548",
    "offload_update": "cache_utils.py:771-779",
    "generate_skips": "generation/utils.py:1827-1835",
}


@dataclass(frozen=True)
class CacheRow:
    """One transformers cache class beside its kvlessons equivalent, after the same tokens.

    Bytes are measured from the tensors each cache keeps, each underlying storage once
    (``hf_bytes``; ``kvlessons_bytes`` is ``cache.nbytes()``, measured the same way);
    ``hf_view_bytes`` adds up ``tensor.nbytes`` of what transformers' layers hold as
    they see it, which is less than ``hf_bytes`` when a held tensor is a slice of a
    larger one. ``max_logit_diff`` is max |transformers - kvlessons| over the ``steps``
    decode steps (None for the quantized row, whose two formats differ: ``drift`` holds
    each side's max |quantized - its own full precision| instead, and ``agreement`` the
    steps whose greedy token full precision also chose, transformers first). For
    prompt reuse, ``reused_tokens`` counts, per side, the prompt tokens that the
    continuations did not run through the model again (against generating each one
    from scratch). ``available`` is False when transformers' side could not run here;
    ``note`` says why, and what each side does.
    """

    kind: str
    hf_cache: str
    kvlessons_cache: str
    steps: int
    hf_bytes: int | None = None
    kvlessons_bytes: int | None = None
    hf_view_bytes: int | None = None
    max_logit_diff: float | None = None
    tokens_equal: bool | None = None
    drift: tuple[float | None, float] | None = None
    agreement: tuple[int | None, int] | None = None
    reused_tokens: tuple[int, int] | None = None
    offloaded_bytes: int | None = None
    available: bool = True
    note: str = ""


# ---------------------------------------------------------------------------------------------
# Bytes held: measured from the tensors, as kvlessons.memory.measured_bytes does
# ---------------------------------------------------------------------------------------------


def hf_cache_bytes(cache, device=None) -> tuple[int, int]:
    """(storage bytes, view bytes) held by a transformers cache's layers.

    Storage bytes count each storage once (what memory is pinned); view bytes add up
    ``tensor.nbytes`` of the held tensors (what the layers would report if asked).
    """
    tensors = [t for t in held_tensors(cache.layers) if device is None or t.device == torch.device(device)]
    return storage_bytes(tensors), sum(t.nbytes for t in tensors)


# ---------------------------------------------------------------------------------------------
# Running the two sides on the same tokens
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def kvlessons_logits(model, cache, ids: torch.Tensor, steps: int, forced: torch.Tensor | None = None):
    """Prefill ``ids`` (1, T) into ``cache``, then decode; return (logits (steps, vocab), argmax tokens (steps,)).

    Without ``forced`` each step feeds the token the previous step chose (greedy);
    with it, step i feeds ``forced[i - 1]`` whatever was chosen (teacher forcing), so a
    cache that stores something else (quantized) sees the same inputs as the reference.
    """
    logits = [model(ids, cache, last_only=True)[0, -1]]
    for i in range(1, steps):
        token = logits[-1].argmax() if forced is None else forced[i - 1]
        logits.append(model(token.view(1, 1), cache, last_only=True)[0, -1])
    logits = torch.stack(logits).float()
    return logits, logits.argmax(-1)


@torch.no_grad()
def hf_logits(hf_model, cache, ids: torch.Tensor, forced: torch.Tensor):
    """Prefill ``ids`` (1, T) into transformers' ``cache``, then feed ``forced[:-1]`` one by one.

    Returns (logits (steps, vocab), argmax tokens (steps,)), steps = len(forced).
    Positions are given as ``cache_position``, as ``generate`` does: StaticCache would
    otherwise count its length from non-zero rows.
    """
    t, dev = ids.shape[1], ids.device
    out = hf_model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                   cache_position=torch.arange(t, device=dev)).logits
    logits = [out[0, -1]]
    for i, token in enumerate(forced[:-1]):
        out = hf_model(token.view(1, 1), past_key_values=cache, use_cache=True,
                       cache_position=torch.tensor([t + i], device=dev)).logits
        logits.append(out[0, -1])
    logits = torch.stack(logits).float()
    return logits, logits.argmax(-1)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _pair_row(kind, hf_model, hf_cache, hf_label, model, kv_cache, kv_label, ids, steps, note):
    """A row for two caches that store the same thing: same logits and tokens expected. Also returns kvlessons' run."""
    kv_out, kv_tokens = kvlessons_logits(model, kv_cache, ids, steps)
    hf_out, hf_tokens = hf_logits(hf_model, hf_cache, ids, kv_tokens)
    held, seen = hf_cache_bytes(hf_cache)
    row = CacheRow(kind, hf_label, kv_label, steps, hf_bytes=held, kvlessons_bytes=kv_cache.nbytes(),
                   hf_view_bytes=seen, max_logit_diff=_max_diff(hf_out, kv_out),
                   tokens_equal=bool(torch.equal(hf_tokens, kv_tokens)), note=note)
    return row, (kv_out, kv_tokens, hf_out, hf_tokens)


# ---------------------------------------------------------------------------------------------
# The same weights with a sliding window on every layer
# ---------------------------------------------------------------------------------------------


def tiny_with_window(model: TinyDecoder, window: int) -> TinyDecoder:
    """``model``'s weights (shared, not copied) in a TinyDecoder whose every layer has a sliding ``window``."""
    require_positive_int("window", window)
    config = dataclasses.replace(model.config, windows=(window,) * model.config.layers)
    with torch.device("meta"):  # placeholders only: every parameter is replaced by model's own tensor
        windowed = TinyDecoder(config)
    windowed.load_state_dict(model.state_dict(), assign=True)
    if model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr():
        windowed.lm_head.weight = windowed.embed.weight  # tied in model: one matrix here too
    return windowed.eval()


def mistral_with_window(hf_model, window: int):
    """transformers' Mistral holding ``hf_model``'s Llama weights (shared, not copied), with ``sliding_window``.

    Mistral is Llama's layer layout plus a sliding window that its mask applies
    (key k is visible to query q when q - window < k <= q, as in kvlessons). transformers'
    Llama has no window at all, so this is how the same weights run windowed there.
    """
    from ..pretrained import _offline_transformers
    from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding

    transformers = _offline_transformers()
    require_positive_int("window", window)
    c = hf_model.config
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False) or getattr(c, "rope_scaling", None):
        raise ValueError("hf_model must be a plain Llama (no attention or MLP biases, no rope_scaling) to run as Mistral")
    config = transformers.MistralConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id, sliding_window=window, attn_implementation=c._attn_implementation,
    )
    with torch.device("meta"):  # no weights allocated: Llama's own tensors are assigned below
        mistral = transformers.MistralForCausalLM(config)
    mistral.load_state_dict(hf_model.state_dict(), assign=True)
    mistral.tie_weights()
    device = hf_model.device
    # The rotary table is a computed buffer, not a weight: build it for real on the model's device.
    mistral.model.rotary_emb = MistralRotaryEmbedding(config=config, device=device)
    if any(t.is_meta for t in [*mistral.parameters(), *mistral.buffers()]):
        raise RuntimeError("a Mistral tensor was left unloaded (its Llama weight names differ)")
    return mistral.to(dtype=hf_model.dtype).eval()


def _sliding_rows(hf_model, model, ids, steps, window, max_len):
    """Dynamic and static sliding-window caches: transformers' Mistral beside a windowed TinyDecoder."""
    transformers = _transformers()
    mistral, tiny = mistral_with_window(hf_model, window), tiny_with_window(model, window)
    dynamic_note = (
        f"transformers keeps window-1 = {window - 1} positions per layer ({_WHERE['sliding_keep']}: the next "
        f"query brings its own key), as a slice of the tensor torch.cat made, so the memory it pins is a whole "
        f"window after a decode step (and the whole prompt right after the prefill); kvlessons keeps a ring "
        f"of window = {window} slots. Mistral needs DynamicCache(config=...) to get sliding layers at all: "
        f"a bare DynamicCache() keeps every position (the mask still windows, so the logits agree)."
    )
    dynamic, _ = _pair_row(
        "sliding window (dynamic)", mistral, transformers.DynamicCache(config=mistral.config),
        f"DynamicCache(config) on Mistral, sliding_window={window}", tiny, ConcatCache(),
        f"ConcatCache(), windows={window} on every layer", ids, steps, dynamic_note)
    static_note = (
        f"both preallocate min(window, max_len) = {min(window, max_len)} positions per layer: transformers "
        f"rolls its buffer left by one each decode step ({_WHERE['static_sliding']}), kvlessons writes "
        f"position p into slot p % window."
    )
    static, _ = _pair_row(
        "sliding window (static)", mistral, transformers.StaticCache(config=mistral.config, max_cache_len=max_len),
        f"StaticCache(max_cache_len={max_len}) on Mistral, sliding_window={window}", tiny, StaticCache(max_len),
        f"StaticCache({max_len}), windows={window} on every layer", ids, steps, static_note)
    return [dynamic, static]


# ---------------------------------------------------------------------------------------------
# Quantized, offloaded, reused
# ---------------------------------------------------------------------------------------------


def _transformers():
    from ..pretrained import _offline_transformers

    return _offline_transformers()


def quantized_backend(backend: str = "auto") -> tuple[str | None, str]:
    """(backend transformers' QuantizedCache can use here, or None; why not, when None).

    transformers ships the quantized cache's logic but not its quantizers: "quanto" needs
    optimum-quanto >= 0.2.5, "hqq" needs hqq, and neither is a dependency of the course.
    """
    if backend not in QUANT_BACKENDS:
        raise ValueError(f"quant_backend must be one of {QUANT_BACKENDS}, got {backend!r}")
    from transformers.utils.import_utils import is_hqq_available, is_optimum_quanto_available, is_quanto_greater

    have = {"quanto": is_optimum_quanto_available() and is_quanto_greater("0.2.5", accept_dev=True),
            "hqq": is_hqq_available()}
    wanted = ["quanto", "hqq"] if backend == "auto" else [backend]
    for name in wanted:
        if have[name]:
            return name, ""
    need = {"quanto": "optimum-quanto>=0.2.5", "hqq": "hqq"}
    return None, ("transformers' QuantizedCache quantizes with " + " or ".join(need[n] for n in wanted)
                  + ", not installed here (neither is a course dependency)")


def _quantized_note(residual: int, fmt: str) -> str:
    """What each quantized cache keeps in full precision and when it quantizes: why their drifts differ."""
    return (
        f"transformers quantizes the whole prompt at the prefill (whose attention still reads full precision), "
        f"keeps new tokens in a full-precision tail, and when the tail would reach residual_length = {residual} "
        f"re-quantizes everything, the already quantized part included ({_WHERE['quantized_update']}): "
        f"{QUANT_NBITS}-bit integers with a scale and zero point per group of 64 values. kvlessons keeps the "
        f"newest {residual} tokens in full precision at every step and quantizes each token once, as it leaves "
        f"the tail ({fmt}: E2M1 codes with an E4M3 scale per 16 values and one fp32 scale per tensor). "
        f"Drift: max |quantized - full precision| logits of each side's own full-precision run."
    )


def _quantized_row(hf_model, model, ids, steps, residual, fmt, backend, reference):
    """Each side's quantized cache against its own full-precision run, on the same (reference) tokens."""
    kv_ref, kv_tokens, hf_ref, hf_ref_tokens = reference
    kv_cache = QuantizedCache(fmt, residual=residual)
    kv_out, kv_q_tokens = kvlessons_logits(model, kv_cache, ids, steps, forced=kv_tokens)
    kv_drift, kv_agree = _max_diff(kv_out, kv_ref), int((kv_q_tokens == kv_tokens).sum())
    kv_label = f"kvlessons.fp4.QuantizedCache({fmt!r}, residual={residual})"
    name, reason = quantized_backend(backend)
    if name is None:
        label = f"QuantizedCache('quanto' or 'hqq', nbits={QUANT_NBITS}, residual_length={residual})"
        return CacheRow("quantized", label, kv_label, steps, kvlessons_bytes=kv_cache.nbytes(),
                        drift=(None, kv_drift), agreement=(None, kv_agree), available=False,
                        note=f"unavailable here: {reason}. " + _quantized_note(residual, fmt))
    transformers = _transformers()
    cls = transformers.QuantoQuantizedCache if name == "quanto" else transformers.HQQQuantizedCache
    hf_cache = cls(config=hf_model.config, nbits=QUANT_NBITS, residual_length=residual)
    hf_out, hf_q_tokens = hf_logits(hf_model, hf_cache, ids, kv_tokens)
    held, seen = hf_cache_bytes(hf_cache)
    return CacheRow("quantized", f"{cls.__name__}(nbits={QUANT_NBITS}, residual_length={residual})", kv_label, steps,
                    hf_bytes=held, kvlessons_bytes=kv_cache.nbytes(), hf_view_bytes=seen,
                    drift=(_max_diff(hf_out, hf_ref), kv_drift),
                    agreement=(int((hf_q_tokens == hf_ref_tokens).sum()), kv_agree),
                    note=_quantized_note(residual, fmt))


def _offloaded_row(hf_model, ids, steps, reference, kv_bytes):
    """DynamicCache(offloading=True) against kvlessons' ConcatCache run (nothing is offloaded in kvlessons)."""
    kv_ref, kv_tokens, _, _ = reference
    transformers = _transformers()
    label, kv_label = "DynamicCache(offloading=True)", "ConcatCache() (kept on the device)"
    what = (f"after each layer's update transformers moves that layer's K/V to the CPU and prefetches the next "
            f"layer's back on a separate stream ({_WHERE['offload_update']}); OffloadedCache is its deprecated alias.")
    try:  # only transformers' own calls: whatever they raise is the reason this row cannot run here
        cache = transformers.DynamicCache(offloading=True)
        hf_out, hf_tokens = hf_logits(hf_model, cache, ids, kv_tokens)
    except (AssertionError, RuntimeError, ValueError, TypeError) as err:
        return CacheRow("offloaded", label, kv_label, steps, kvlessons_bytes=kv_bytes, available=False,
                        note=f"unavailable here: {type(err).__name__}: {err} (Cache.update waits on "
                             f"torch.cuda.default_stream, so it needs a CUDA build of torch and a CUDA model); " + what)
    device = hf_model.device
    on_device, _ = hf_cache_bytes(cache, device)
    offloaded = 0 if device.type == "cpu" else hf_cache_bytes(cache, "cpu")[0]
    return CacheRow("offloaded", label, kv_label, steps, hf_bytes=on_device, kvlessons_bytes=kv_bytes,
                    hf_view_bytes=hf_cache_bytes(cache)[1], max_logit_diff=_max_diff(hf_out, kv_ref),
                    tokens_equal=bool(torch.equal(hf_tokens, kv_tokens)), offloaded_bytes=offloaded,
                    note=f"hf_bytes: held on {device}; offloaded_bytes: held on the CPU. " + what)


class _TokenCounter:
    """Counts the token positions a module (the embedding) is run on: prompt tokens computed, not skipped."""

    def __init__(self, module):
        self.tokens = 0
        self._handle = module.register_forward_pre_hook(self._count)

    def _count(self, _module, inputs):
        self.tokens += inputs[0].shape[-1]

    def close(self) -> int:
        self._handle.remove()
        return self.tokens


@torch.no_grad()
def _hf_generate(hf_model, full, steps, cache=None):
    """transformers' greedy ``generate`` of exactly ``steps`` tokens (no stop token); returns (tokens, raw logits)."""
    extra = {} if cache is None else {"past_key_values": cache}
    out = hf_model.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=steps, do_sample=False,
                            eos_token_id=None, pad_token_id=0, output_logits=True,
                            return_dict_in_generate=True, **extra)
    return out.sequences[0, full.shape[1]:], torch.cat(out.logits).float()


def _hf_reuse(hf_model, prefix, continuations, steps):
    """transformers' documented pattern: prefill a DynamicCache on the prefix once, deepcopy it per continuation."""
    transformers = _transformers()
    prefix_cache = transformers.DynamicCache()
    with torch.no_grad():
        hf_model(prefix, past_key_values=prefix_cache, use_cache=True, logits_to_keep=1)
    runs, embed = [], hf_model.get_input_embeddings()
    reused = _TokenCounter(embed)
    for cont in continuations:
        full = torch.cat([prefix, cont], dim=1)
        runs.append(_hf_generate(hf_model, full, steps, copy.deepcopy(prefix_cache)))
    reused_fed = reused.close()
    scratch = _TokenCounter(embed)
    fresh = [_hf_generate(hf_model, torch.cat([prefix, cont], dim=1), steps)[0] for cont in continuations]
    return prefix_cache, runs, fresh, scratch.close() - reused_fed


def _kv_reuse(model, prefix, continuations, steps):
    """The same with kvlessons: a ConcatCache prefilled on the prefix once, deep-copied for each continuation."""
    prefix_cache = ConcatCache()
    with torch.no_grad():
        model(prefix, prefix_cache, last_only=True)
    reused = _TokenCounter(model.embed)
    runs = [generate(model, cont, steps, cache=copy.deepcopy(prefix_cache)) for cont in continuations]
    reused_fed = reused.close()
    scratch = _TokenCounter(model.embed)
    fresh = [generate(model, torch.cat([prefix, cont], dim=1), steps, cache=ConcatCache()).new_tokens[0]
             for cont in continuations]
    return prefix_cache, runs, fresh, scratch.close() - reused_fed


def _reuse_row(hf_model, model, prefix, continuations, steps):
    """Both reuse patterns, each against generating every continuation from scratch, and against each other."""
    hf_cache, hf_runs, hf_fresh, hf_saved = _hf_reuse(hf_model, prefix, continuations, steps)
    kv_cache, kv_runs, kv_fresh, kv_saved = _kv_reuse(model, prefix, continuations, steps)
    same = all(torch.equal(h[0], f) and torch.equal(k.new_tokens[0], f) and torch.equal(h[0], g)
               for h, f, k, g in zip(hf_runs, hf_fresh, kv_runs, kv_fresh))
    diff = max(_max_diff(h[1], k.logits[0].float()) for h, k in zip(hf_runs, kv_runs))
    held, seen = hf_cache_bytes(hf_cache)
    n, p = len(continuations), prefix.shape[1]
    note = (f"the {p}-token prompt is prefilled once; each of the {n} continuations starts from a deep copy of "
            f"that cache and generate begins at the cache's length ({_WHERE['generate_skips']}), so only the "
            f"continuation's own tokens are run: {n} x {p} prompt tokens not recomputed, measured by counting the "
            f"positions each model's embedding saw. Same tokens: every continuation against generating it from "
            f"scratch, on both sides, and the two sides against each other. Bytes: the shared prompt's cache; "
            f"each copy holds as much again while it runs (kvlessons.paging.PagedKVCache shares the prompt's "
            f"blocks instead of copying them).")
    return CacheRow("prompt reuse", "DynamicCache() prefilled once, copy.deepcopy per generate call",
                    "ConcatCache() prefilled once, copy.deepcopy per generate call", steps, hf_bytes=held,
                    kvlessons_bytes=kv_cache.nbytes(), hf_view_bytes=seen, max_logit_diff=diff, tokens_equal=same,
                    reused_tokens=(hf_saved, kv_saved), note=note)


# ---------------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------------


def _check_ids(name: str, ids, vocab_size: int) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"{name} must be a (1, T) tensor of token ids with T >= 1, got {shape}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"{name} must hold ids in [0, {vocab_size}), got {int(ids.min())} to {int(ids.max())}")


def _check_models(hf_model, model) -> None:
    if not isinstance(model, TinyDecoder):
        raise ValueError(f"model must be a kvlessons TinyDecoder, got {type(model).__name__}")
    if not hasattr(hf_model, "config") or not hasattr(hf_model, "generate"):
        raise ValueError(f"hf_model must be a transformers causal LM, got {type(hf_model).__name__}")
    c = hf_model.config
    theirs = (c.num_hidden_layers, c.num_key_value_heads, c.head_dim, c.vocab_size)
    ours = (model.config.layers, model.config.kv_heads, model.config.head_dim, model.config.vocab_size)
    if theirs != ours:
        raise ValueError(f"hf_model (layers, kv_heads, head_dim, vocab) {theirs} does not match model's {ours}")
    if any(w is not None for w in model.config.windows):
        raise ValueError("model must have full attention on every layer (the sliding rows add the window themselves)")
    if hf_model.dtype != model.embed.weight.dtype or hf_model.device != model.device:
        raise ValueError(f"hf_model ({hf_model.dtype} on {hf_model.device}) and model "
                         f"({model.embed.weight.dtype} on {model.device}) must share dtype and device")


def _default_continuations(ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Two continuations made of the prompt's own last (up to) 8 tokens: as they are, and reversed."""
    tail = ids[:, -min(8, ids.shape[1]):]
    return tail, tail.flip(-1)


def compare_hf_caches(hf_model, model, ids: torch.Tensor, *, new_tokens: int = 8, window: int = 32,
                      max_len: int | None = None, residual: int = 4, quant_format: str = "nvfp4",
                      quant_backend: str = "auto", continuations=None) -> list[CacheRow]:
    """Run each transformers cache class and its kvlessons equivalent on the same prompt; one :class:`CacheRow` each.

    ``hf_model``: transformers' SmolLM2 (:func:`kvlessons.pretrained.load_hf_model`);
    ``model``: the same weights in kvlessons (:func:`kvlessons.pretrained.load_smollm2`),
    same dtype and device. ``ids`` (1, T): the prompt; each row prefills it and decodes
    ``new_tokens`` steps. ``window``: the sliding rows' window, shorter than the prompt
    (otherwise nothing slides). ``max_len``: the static caches' length (default
    T + new_tokens). ``residual``: the quantized caches' full-precision tail, small by
    default so that transformers' tail fills and is flushed within a few steps.
    ``quant_format``: kvlessons' format ("nvfp4" or "fp8"). ``quant_backend``: "quanto",
    "hqq" or "auto" (whichever is installed; if none, that row says so). ``continuations``:
    (1, S) tensors that the prompt-reuse row appends to ``ids`` (default: the prompt's
    last 8 tokens, as they are and reversed).

    Rows: dynamic, static, sliding window (dynamic), sliding window (static), quantized,
    offloaded, prompt reuse: about 140 forward passes of the 135M model, some 6 s on a quiet
    2-core CPU for a 50-100 token prompt (kvlessons' quantized cache, which dequantizes every
    layer at every step, is a third of it).
    """
    _check_models(hf_model, model)
    _check_ids("ids", ids, model.config.vocab_size)
    steps = require_positive_int("new_tokens", new_tokens)
    t = ids.shape[1]
    require_positive_int("window", window)
    if window >= t:
        raise ValueError(f"window must be shorter than the prompt ({t} tokens) for anything to slide, got {window}")
    max_len = t + steps if max_len is None else require_positive_int("max_len", max_len)
    if max_len < t + steps:
        raise ValueError(f"max_len must hold the prompt and the new tokens ({t} + {steps}), got {max_len}")
    require_positive_int("residual", residual, allow_zero=True)
    if quant_format not in QUANT_FORMATS:
        raise ValueError(f"quant_format must be one of {QUANT_FORMATS}, got {quant_format!r}")
    quantized_backend(quant_backend)  # validates the name now, before any model runs
    continuations = _default_continuations(ids) if continuations is None else tuple(continuations)
    if not continuations:
        raise ValueError("continuations must hold at least one (1, S) tensor")
    for cont in continuations:
        _check_ids("continuations", cont, model.config.vocab_size)

    transformers = _transformers()
    dynamic, reference = _pair_row(
        "dynamic", hf_model, transformers.DynamicCache(), "DynamicCache()", model, ConcatCache(), "ConcatCache()",
        ids, steps, "both grow by torch.cat along the sequence, one tensor per layer for K and one for V.")
    static, _ = _pair_row(
        "static", hf_model, transformers.StaticCache(config=hf_model.config, max_cache_len=max_len),
        f"StaticCache(max_cache_len={max_len})", model, StaticCache(max_len), f"StaticCache({max_len})", ids, steps,
        f"both allocate all {max_len} positions at the first write and write in place; the bytes count them all.")
    return [
        dynamic,
        static,
        *_sliding_rows(hf_model, model, ids, steps, window, max_len),
        _quantized_row(hf_model, model, ids, steps, residual, quant_format, quant_backend, reference),
        _offloaded_row(hf_model, ids, steps, reference, dynamic.kvlessons_bytes),
        _reuse_row(hf_model, model, ids, continuations, steps),
    ]


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


def _bytes(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _logit_cell(row: CacheRow) -> str:
    if row.drift is not None:
        hf, kv = row.drift
        return f"drift {'-' if hf is None else f'{hf:.3g}'} / {kv:.3g}"
    return "-" if row.max_logit_diff is None else f"{row.max_logit_diff:.1e}"


def _tokens_cell(row: CacheRow) -> str:
    if row.agreement is not None:
        hf, kv = row.agreement
        return f"{'-' if hf is None else hf}/{row.steps}, {kv}/{row.steps} as fp32"
    if row.tokens_equal is None:
        return "-"
    return "yes" if row.tokens_equal else "NO"


def format_cache_rows(rows: list[CacheRow]) -> str:
    """A plain-text table of :func:`compare_hf_caches`'s rows, then each row's note (the why behind the numbers)."""
    header = ("cache", "transformers bytes", "kvlessons bytes", "max |Δ logit|", "same tokens")
    cells = [(r.kind, _bytes(r.hf_bytes), _bytes(r.kvlessons_bytes), _logit_cell(r), _tokens_cell(r)) for r in rows]
    widths = [max(len(str(line[i])) for line in [header, *cells]) for i in range(len(header))]
    fmt = lambda line: "  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w)  # noqa: E731
                                 for i, (v, w) in enumerate(zip(line, widths)))
    lines = [fmt(header), fmt(["-" * w for w in widths]), *map(fmt, cells), ""]
    for r in rows:
        extra = []
        if r.hf_view_bytes is not None and r.hf_view_bytes != r.hf_bytes:
            extra.append(f"its layers' tensors add up to {format_bytes(r.hf_view_bytes)} as slices")
        if r.reused_tokens is not None:
            extra.append(f"prompt tokens not recomputed: {r.reused_tokens[0]} (transformers), "
                         f"{r.reused_tokens[1]} (kvlessons)")
        if r.offloaded_bytes:
            extra.append(f"{format_bytes(r.offloaded_bytes)} offloaded to the CPU")
        lines.append(f"{r.kind}: {r.hf_cache} vs {r.kvlessons_cache}.")
        lines.append("    " + r.note + ("" if not extra else " [" + "; ".join(extra) + "]"))
    return "\n".join(lines)

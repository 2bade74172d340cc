"""How much KV cache a serving engine of vLLM's design leaves on a GPU, and what that buys (lesson 11).

An engine such as vLLM sizes its paged pool (lesson 06) once, at start-up, by subtraction:

    kv_cache_bytes = gpu_memory x gpu_memory_utilization
                     - weights - activation peak (of one profiling run) - non-torch memory
    num_blocks     = kv_cache_bytes // (block_size x bytes per token over every layer, K and V)
    tokens         = num_blocks x block_size
    concurrency    = tokens / max_model_len      (vLLM's "Maximum concurrency ... x")

The bytes per token are lesson 02's formula (:func:`kvlessons.memory.kv_bytes_per_token`)
in the cache dtype; nothing here counts them again. What is new is the subtraction: the
cache gets what is left, so a bigger model, a bigger profiling batch or a higher
``max_model_len`` (which sizes that batch) all shrink it.

The accounting follows vLLM's V0 worker (v0.6 to v0.8), which logs every term. This
module reproduces its published start-up logs:

- https://github.com/vllm-project/vllm/issues/10517 (Llama-3.1-8B-Instruct, RTX 3090):
  ``total_gpu_memory=23.58GiB peak_torch_memory=17.06GiB non_torch_memory=0.35GiB
  kv_cache_size=3.81GiB gpu_memory_utilization=0.90``, ``GPU blocks: 1952``,
  ``Maximum concurrency for 20000 tokens per request: 1.56x``; and with
  ``--max-model-len 29000`` a larger profiling peak (17.98 GiB), 2.89 GiB, 1478 blocks,
  0.82x, and the refusal to start because 29000 > 23648 tokens.
- https://github.com/LMCache/LMCache/issues/1739 (a V1 log, Qwen3-14B):
  ``Available KV cache memory: 6.51 GiB``, ``GPU KV cache size: 42,656 tokens``,
  ``Maximum concurrency for 32,768 tokens per request: 1.30x``.
- https://github.com/vllm-project/vllm/pull/13596 (where V1 began logging tokens):
  127626 blocks printed as ``GPU KV cache size: 2,042,016 tokens`` and 997.08x for 2,048.

Logs round GiB to two decimals, so a log's inputs pin the block count only to within a
few blocks; the tests say how many.

Two simplifications, both vLLM's own: every cache-owning layer gets a slot per token in
every block (a sliding-window layer is not given fewer), and ``max_model_len`` is not
checked against the model's trained context (a preset's ``context`` is ignored).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

from ..memory.formats import storage_format
from ..memory.formula import format_bytes, kv_bytes_per_token
from ..memory.presets import PRESETS, Preset
from ..shape import ModelShape, require_positive_int

GIB = 2**30  # vLLM's logs say GiB (and "GB" for the weights line) and mean 2**30 bytes

# vLLM's names for --kv-cache-dtype: "auto" stores the cache in the model's dtype; the
# fp8 variants (E4M3 or E5M2) all take one byte per value, which is all that counts here.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
MODEL_DTYPES = ("fp32", "fp16", "bf16")


# --- checks ----------------------------------------------------------------------------------

def _require_bytes(name: str, value, *, positive: bool = False) -> float:
    """``value`` as a number of bytes (int or float, finite, >= 0 or > 0); else ValueError naming ``name``.

    Floats are allowed because logged figures are GiB with decimals (23.58 * GIB).
    """
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of bytes, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {'positive' if positive else 'non-negative'}, got {value}")
    return value


def _require_fraction(name: str, value) -> float:
    """``value`` if 0 < value <= 1 (the range vLLM's config accepts); else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not 0 < value <= 1:
        raise ValueError(f"{name} must be a fraction in (0, 1], got {value!r}")
    return value


def _resolve_model(model) -> tuple[str, ModelShape]:
    """A display name and the cache shape, from a ModelShape, a Preset or a preset's name."""
    if isinstance(model, ModelShape):
        return str(model), model
    if isinstance(model, Preset):
        return model.name, model.shape
    if isinstance(model, str) and model in PRESETS:
        return model, PRESETS[model].shape
    raise ValueError(f"model must be a ModelShape, a Preset or one of {', '.join(PRESETS)}; got {model!r}")


def _dtype_name(dtype) -> str | None:
    """The dtype table's name for ``dtype`` ('bfloat16' -> 'bf16'), or None if it has none."""
    try:
        return storage_format(dtype).name if isinstance(dtype, str) else None
    except ValueError:
        return None


def _cache_dtype(kv_cache_dtype, model_dtype) -> str:
    """The storage format the pool uses: the model's dtype for 'auto', one-byte fp8 otherwise."""
    model_name = _dtype_name(model_dtype)
    if model_name not in MODEL_DTYPES:
        raise ValueError(f"model_dtype must be one of {', '.join(MODEL_DTYPES)} (or an alias such as 'bfloat16'); "
                         f"got {model_dtype!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (vLLM's names); "
                         f"got {kv_cache_dtype!r}")
    return model_name if kv_cache_dtype == "auto" else "fp8"


# --- the accounting --------------------------------------------------------------------------

def bytes_per_block(model, block_size: int = 16, kv_cache_dtype: str = "auto", model_dtype: str = "bf16") -> int:
    """Bytes of one pool block: ``block_size`` tokens' K and V (or latents) in every cache-owning layer.

    vLLM allocates a block for all layers at once, so this is the unit the subtraction is
    divided by. Any positive ``block_size`` is accepted, as SGLang's ``--page-size`` and
    lesson 06's pool accept; vLLM's config lists 1, 8, 16, 32, 64 and 128 (16 by default on
    CUDA, where some versions accept only sizes up to 32; v0.6's CLI offered 8, 16, 32).
    """
    _, shape = _resolve_model(model)
    require_positive_int("block_size", block_size)
    return block_size * kv_bytes_per_token(shape, _cache_dtype(kv_cache_dtype, model_dtype))


@dataclass(frozen=True)
class MemoryAccount:
    """The start-up subtraction, term by term (all in bytes)."""

    gpu_memory_bytes: float
    gpu_memory_utilization: float
    weights_bytes: float
    activation_peak_bytes: float
    non_torch_bytes: float

    @property
    def usable_bytes(self) -> float:
        """What the engine may take in all: total x utilization."""
        return self.gpu_memory_bytes * self.gpu_memory_utilization

    @property
    def other_bytes(self) -> float:
        """Everything that is not cache: weights, the activation peak, non-torch allocations."""
        return self.weights_bytes + self.activation_peak_bytes + self.non_torch_bytes

    @property
    def kv_cache_bytes(self) -> int:
        """Whole bytes left for the cache (negative when the rest does not even fit)."""
        return math.floor(self.usable_bytes - self.other_bytes)


def memory_account(gpu_memory_bytes, *, weights_bytes, activation_peak_bytes, non_torch_bytes=0,
                   gpu_memory_utilization: float = 0.9) -> MemoryAccount:
    """Check and record the terms of the subtraction (no model needed yet).

    ``activation_peak_bytes`` is the peak of one profiling forward pass beyond the weights
    (vLLM's ``peak_torch_memory`` is weights plus this); it grows with the tokens of that
    pass, ``max_num_batched_tokens``, which is at least ``max_model_len`` when prefill is
    not chunked (vllm#10517 shows the peak rising from 17.06 to 17.98 GiB as it goes from
    20000 to 29000). ``non_torch_bytes`` is what the CUDA context, NCCL and the like hold
    outside PyTorch's allocator: a few hundred MiB in the logs cited above.
    """
    return MemoryAccount(
        _require_bytes("gpu_memory_bytes", gpu_memory_bytes, positive=True),
        _require_fraction("gpu_memory_utilization", gpu_memory_utilization),
        _require_bytes("weights_bytes", weights_bytes),
        _require_bytes("activation_peak_bytes", activation_peak_bytes),
        _require_bytes("non_torch_bytes", non_torch_bytes),
    )


@dataclass(frozen=True)
class EngineCapacity:
    """The pool an engine starts with, and what it means for requests of ``max_model_len`` tokens.

    Derived figures are properties, so they cannot disagree with the fields they come from.
    """

    model: str
    shape: ModelShape
    kv_cache_dtype: str  # as asked for ('auto', 'fp8', ...)
    cache_dtype: str  # what is stored ('bf16', 'fp8', ...)
    block_size: int
    bytes_per_token: int
    kv_cache_bytes: int
    max_model_len: int
    max_num_seqs: int
    memory: MemoryAccount | None = None  # None when built from a KV budget alone

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def num_blocks(self) -> int:
        """Whole blocks in the budget: a partial block cannot be handed out."""
        return max(self.kv_cache_bytes, 0) // self.bytes_per_block

    @property
    def tokens(self) -> int:
        """Token slots in the pool (vLLM's "GPU KV cache size: N tokens")."""
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """tokens / max_model_len: how many full-length requests the slots would hold if packed exactly."""
        return self.tokens / self.max_model_len

    @property
    def fits(self) -> bool:
        """Whether one request of ``max_model_len`` tokens fits (vLLM refuses to start otherwise)."""
        return self.max_model_len <= self.tokens

    def sequences_at(self, seq_len: int) -> int:
        """Requests of ``seq_len`` tokens that can hold their whole cache at once.

        Each needs ceil(seq_len / block_size) whole blocks, and the scheduler runs at most
        ``max_num_seqs``; so this is an integer, at most ``max_concurrency`` at
        ``max_model_len``, and it says nothing of prefix sharing, which lets requests with a
        common prefix share blocks (lesson 06).
        """
        require_positive_int("seq_len", seq_len)
        return min(self.max_num_seqs, self.num_blocks // math.ceil(seq_len / self.block_size))

    def vllm_log(self) -> str:
        """The figures as vLLM's start-up log prints them (V0's block count, then V1's two lines)."""
        return (f"# GPU blocks: {self.num_blocks}\n"
                f"GPU KV cache size: {self.tokens:,} tokens\n"
                f"Maximum concurrency for {self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x")

    def __str__(self) -> str:
        def gib(n):  # the memory terms in GiB to two decimals, as vLLM logs them
            return f"{n / GIB:.2f} GiB"

        lines = [f"{self.model}, KV cache in {self.cache_dtype} (kv_cache_dtype={self.kv_cache_dtype!r})"]
        m = self.memory
        if m is not None:
            lines += [
                f"  {'GPU memory ' + gib(m.gpu_memory_bytes) + ' x utilization ' + f'{m.gpu_memory_utilization:.2f}':<46}"
                f"{gib(m.usable_bytes):>11}",
                f"  {'- weights':<46}{gib(m.weights_bytes):>11}",
                f"  {'- activation peak (profiling pass)':<46}{gib(m.activation_peak_bytes):>11}",
                f"  {'- non-torch (CUDA context, NCCL, ...)':<46}{gib(m.non_torch_bytes):>11}",
            ]
        what = "K and V" if self.shape.latent_dim is None else "one latent"
        lines += [
            f"  {'= KV cache':<46}{gib(max(self.kv_cache_bytes, 0)):>11}",
            f"  per token {format_bytes(self.bytes_per_token)} ({what}, {len(self.shape.cache_layers)} cache layers), "
            f"per block of {self.block_size} tokens {format_bytes(self.bytes_per_block)}",
            f"  {self.num_blocks:,} blocks = {self.tokens:,} token slots",
            f"  max_model_len {self.max_model_len:,}: concurrency {self.max_concurrency:.2f}x "
            f"(token slots / max_model_len)",
            f"  requests of {self.max_model_len:,} tokens with their whole cache at once: "
            f"{self.sequences_at(self.max_model_len):,} (max_num_seqs {self.max_num_seqs})",
        ]
        return "\n".join(lines)


def _check_startable(cap: EngineCapacity) -> None:
    """Refuse what vLLM refuses at start-up: no block at all, or a max_model_len the pool cannot hold."""
    if cap.num_blocks == 0:
        missing = cap.bytes_per_block - cap.kv_cache_bytes  # the budget may be negative: the rest did not fit
        m = cap.memory
        if m is None:
            where = f"kv_cache_bytes ({format_bytes(cap.kv_cache_bytes)}) is less than one block"
        else:
            where = (f"weights_bytes + activation_peak_bytes + non_torch_bytes ({format_bytes(math.floor(m.other_bytes))}) "
                     f"leave {format_bytes(max(cap.kv_cache_bytes, 0))} of gpu_memory_bytes x gpu_memory_utilization "
                     f"({format_bytes(math.floor(m.usable_bytes))})")
        raise ValueError(
            f"no available memory for the cache blocks: {where}, and one block of {cap.block_size} tokens needs "
            f"{format_bytes(cap.bytes_per_block)}: {format_bytes(missing)} is missing (raise gpu_memory_utilization, "
            f"or shrink the weights, the activation peak or the block)"
        )
    if not cap.fits:
        needed = math.ceil(cap.max_model_len / cap.block_size) - cap.num_blocks
        raise ValueError(
            f"max_model_len ({cap.max_model_len:,}) is larger than the KV cache holds ({cap.tokens:,} tokens in "
            f"{cap.num_blocks:,} blocks of {cap.block_size}): vLLM refuses to start. The largest max_model_len "
            f"that fits is {cap.tokens:,}; this one needs {needed:,} more blocks "
            f"({format_bytes(needed * cap.bytes_per_block)})"
        )


def _capacity(model, kv_cache_bytes: int, memory, *, max_model_len, block_size, kv_cache_dtype, model_dtype,
              max_num_seqs, require_fit) -> EngineCapacity:
    name, shape = _resolve_model(model)
    per_block = bytes_per_block(shape, block_size, kv_cache_dtype, model_dtype)
    cap = EngineCapacity(
        model=name, shape=shape, kv_cache_dtype=kv_cache_dtype, cache_dtype=_cache_dtype(kv_cache_dtype, model_dtype),
        block_size=block_size, bytes_per_token=per_block // block_size, kv_cache_bytes=kv_cache_bytes,
        max_model_len=require_positive_int("max_model_len", max_model_len),
        max_num_seqs=require_positive_int("max_num_seqs", max_num_seqs), memory=memory,
    )
    if require_fit:
        _check_startable(cap)
    return cap


def capacity_from_budget(model, kv_cache_bytes, *, max_model_len: int, block_size: int = 16,
                         kv_cache_dtype: str = "auto", model_dtype: str = "bf16", max_num_seqs: int = 256,
                         require_fit: bool = True) -> EngineCapacity:
    """The pool that ``kv_cache_bytes`` of cache memory makes (V1 logs this as "Available KV cache memory").

    ``max_num_seqs`` caps the requests the scheduler runs at once (256 is vLLM's
    long-standing default). With ``require_fit`` (the default) a budget without a single
    block, or one that cannot hold one request of ``max_model_len`` tokens, raises
    ValueError as vLLM's start-up does; pass False to look at the figures anyway (vLLM
    prints them before refusing).
    """
    budget = math.floor(_require_bytes("kv_cache_bytes", kv_cache_bytes))
    return _capacity(model, budget, None, max_model_len=max_model_len, block_size=block_size,
                     kv_cache_dtype=kv_cache_dtype, model_dtype=model_dtype, max_num_seqs=max_num_seqs,
                     require_fit=require_fit)


def engine_capacity(model, gpu_memory_bytes, *, weights_bytes, activation_peak_bytes, non_torch_bytes=0,
                    gpu_memory_utilization: float = 0.9, max_model_len: int, block_size: int = 16,
                    kv_cache_dtype: str = "auto", model_dtype: str = "bf16", max_num_seqs: int = 256,
                    require_fit: bool = True) -> EngineCapacity:
    """The KV-cache blocks, tokens and concurrency an engine of vLLM's design starts with on one GPU.

    ``model`` is a ModelShape, a Preset or a preset's name (``kvlessons.memory.PRESETS``);
    ``gpu_memory_bytes`` is the card's total memory. See :func:`memory_account` for the
    other memory terms and :func:`capacity_from_budget` for the rest. Raises ValueError,
    naming the argument, for any bad input; and, like vLLM, when nothing is left for even
    one block ("no available memory for the cache blocks", with how much is missing) or
    when ``max_model_len`` tokens do not fit (with the largest that would).
    """
    account = memory_account(gpu_memory_bytes, weights_bytes=weights_bytes,
                             activation_peak_bytes=activation_peak_bytes, non_torch_bytes=non_torch_bytes,
                             gpu_memory_utilization=gpu_memory_utilization)
    return _capacity(model, account.kv_cache_bytes, account, max_model_len=max_model_len, block_size=block_size,
                     kv_cache_dtype=kv_cache_dtype, model_dtype=model_dtype, max_num_seqs=max_num_seqs,
                     require_fit=require_fit)


# --- the same knobs in vLLM and SGLang -------------------------------------------------------

@dataclass(frozen=True)
class Knob:
    """One setting of a serving engine: its flag in vLLM and in SGLang, and the course's concept behind it."""

    concept: str
    vllm: str
    sglang: str  # "" where SGLang has no flag we could confirm
    controls: str
    lessons: str


# Flags checked against vLLM's engine-argument docs (docs.vllm.ai, v0.6.3 to v0.10) and
# SGLang's server-arguments page (docs/advanced_features/server_arguments.md).
ENGINE_KNOBS: tuple[Knob, ...] = (
    Knob("block (page) size", "--block-size", "--page-size",
         "tokens per block of the paged pool: bigger blocks waste more of each sequence's last block but "
         "need fewer table entries (vLLM: 16 by default on CUDA; SGLang: 1 token per page by default)",
         "06, 11"),
    Knob("cache dtype", "--kv-cache-dtype", "--kv-cache-dtype",
         "how each cached number is stored: 'auto' keeps the model's dtype, fp8 (E4M3 or E5M2) halves a "
         "16-bit cache and so doubles the blocks",
         "02, 05"),
    Knob("prefix caching", "--enable-prefix-caching", "--disable-radix-cache",
         "reusing the blocks of a prompt prefix already cached (vLLM hashes full blocks; SGLang keeps a "
         "radix tree, on unless disabled); freed blocks stay reusable until evicted",
         "06, 11"),
    Knob("memory fraction", "--gpu-memory-utilization", "--mem-fraction-static",
         "vLLM: the share of the card for everything the engine allocates (weights, activation peak, "
         "non-torch, cache), so the cache gets the remainder; SGLang: the share for weights and the KV pool "
         "only, the rest left for activations",
         "02, 11"),
    Knob("running requests", "--max-num-seqs", "--max-running-requests",
         "how many sequences one step may batch; concurrency is the smaller of this and what the blocks hold",
         "06, 11"),
    Knob("context limit", "--max-model-len", "--context-length",
         "the longest prompt plus output allowed; vLLM refuses to start unless one request this long fits "
         "in the cache, and (unchunked) its profiling pass is this long",
         "02, 11"),
    Knob("tokens per step", "--max-num-batched-tokens", "--chunked-prefill-size",
         "how many tokens one forward pass may process: the chunk a long prefill is cut into, and the size "
         "of the profiling pass whose activation peak is subtracted",
         "06, 11"),
    Knob("preemption", "--preemption-mode", "",
         "what happens to a running sequence when the blocks run out: recompute it later, or swap its "
         "blocks to CPU memory (--swap-space GiB per GPU; vLLM's V0 engine: V1 only recomputes); whole "
         "sequences, unlike lesson 10's token eviction",
         "06, 11"),
)

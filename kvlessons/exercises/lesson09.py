"""Lesson 09's exercises: an MLA model's cache bytes per token by hand, and the absorbed query projection."""

from __future__ import annotations

from ..memory import kv_bytes_per_token, preset
from .core import Feedback, NumericExercise, check_parts, raised

__all__ = ["MLA_LATENT_BYTES", "MLA_KV_BYTES", "ABSORB_HINTS", "check_mla_bytes", "check_absorb_query"]

# DeepSeek-V2's attention, as its config.json states it (kvlessons.mla.MLA_CONFIGS holds the same numbers).
V2 = dict(layers=60, heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


def _latent_exercise() -> NumericExercise:
    c = V2
    row = c["kv_lora_rank"] + c["qk_rope_head_dim"]
    answer = kv_bytes_per_token(preset("DeepSeek-V2").shape, "bf16")  # one latent row per layer, from the preset
    working = f"{c['layers']} layers x ({c['kv_lora_rank']} + {c['qk_rope_head_dim']}) values x 2 B"
    return NumericExercise(
        name="mla_latent_bytes",
        question="DeepSeek-V2 caches MLA latents: bytes per token in bf16?",
        answer=answer,
        unit="bytes",
        explanation=f"{working} = {answer:,} bytes ({answer / 1024:.1f} KiB) per token, for all {c['heads']} heads together.",
        mistakes=[
            (c["layers"] * c["kv_lora_rank"] * 2,
             f"The rotary key is missing: besides the {c['kv_lora_rank']}-value latent, each layer caches the "
             f"{c['qk_rope_head_dim']}-value rotated key that all heads share (RoPE cannot be absorbed)."),
            (2 * answer, "Twice the answer: either the latent was counted twice, as a key and as a value (MLA caches one "
                         "vector that serves both), or 4 bytes per value were used (bf16 is 2)."),
            (answer * c["heads"], f"{c['heads']} times too much: the latent is shared by every head; it is stored once "
                                  f"per layer, not once per head."),
            (row * 2, f"That is one layer's share. Every one of the {c['layers']} layers caches its own latent."),
            (answer * 8, "Eight times too much: that counts bits. bf16 is 2 bytes per value."),
            (answer / 1024, "That is KiB; the answer is asked in bytes."),
            (61 * row * 2, "That is DeepSeek-V3 (61 layers); this exercise is DeepSeek-V2, with 60."),
            (c["layers"] * (c["kv_lora_rank"] + c["heads"] * c["qk_rope_head_dim"]) * 2,
             f"The rotary key was counted once per head: it is one {c['qk_rope_head_dim']}-value key shared by all "
             f"{c['heads']} heads (only the queries have a rotary part per head)."),
        ],
        rel_tol=1e-9,  # an exact byte count
        hints=[
            "Per token, each layer stores one latent vector and one small rotated key, shared by all heads.",
            "layers x (kv_lora_rank + qk_rope_head_dim) x bytes per value.",
            f"{working} = {answer:,} bytes.",
        ],
    )


def _kv_exercise() -> NumericExercise:
    c = V2
    key = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    answer = c["layers"] * c["heads"] * (key + c["v_head_dim"]) * 2
    working = (f"{c['layers']} layers x {c['heads']} heads x ({c['qk_nope_head_dim']} + {c['qk_rope_head_dim']} key + "
               f"{c['v_head_dim']} value) x 2 B")
    return NumericExercise(
        name="mla_kv_bytes",
        question="The same model with its keys and values decompressed and cached per head (what transformers' "
                 "DeepseekV3 does): bytes per token in bf16?",
        answer=answer,
        unit="bytes",
        explanation=f"{working} = {answer:,} bytes per token: "
                    f"{answer / kv_bytes_per_token(preset('DeepSeek-V2').shape, 'bf16'):.1f}x the latent cache.",
        mistakes=[
            (c["layers"] * c["heads"] * (c["qk_nope_head_dim"] + c["v_head_dim"]) * 2,
             f"The keys' rotary part is missing: each head's key is {c['qk_nope_head_dim']} decompressed values plus "
             f"the {c['qk_rope_head_dim']} rotary ones (the shared key, copied to every head)."),
            (2 * c["layers"] * c["heads"] * key * 2,
             f"That counts the values as wide as the keys ({key}); the values are v_head_dim = {c['v_head_dim']} wide."),
            (2 * c["layers"] * c["heads"] * c["v_head_dim"] * 2,
             f"That is the textbook 2 x layers x heads x head_dim x 2 B with head_dim {c['v_head_dim']}: MLA's keys "
             f"are wider than its values ({key} against {c['v_head_dim']})."),
            (answer * 2, "Twice the answer: either K and V were counted twice (the key and value widths already add "
                         "up both), or 4 bytes per value were used (bf16 is 2)."),
            (answer // c["layers"], f"That is one layer's share; there are {c['layers']} layers."),
            (answer // c["heads"], f"That is one head's share; each of the {c['heads']} heads keeps its own key and value."),
            (answer / 1024, "That is KiB; the answer is asked in bytes."),
            (answer / 2**20, "That is MiB; the answer is asked in bytes."),
            (answer * 8, "Eight times too much: that counts bits. bf16 is 2 bytes per value."),
            (61 * c["heads"] * (key + c["v_head_dim"]) * 2, "That is DeepSeek-V3 (61 layers); this exercise is DeepSeek-V2, with 60."),
        ],
        rel_tol=1e-9,  # an exact byte count
        hints=[
            "Every head keeps its own key (decompressed part + rotary part) and its own value, in every layer.",
            "layers x heads x (qk_nope_head_dim + qk_rope_head_dim + v_head_dim) x bytes per value.",
            f"{working} = {answer:,} bytes.",
        ],
    )


MLA_LATENT_BYTES = _latent_exercise()
MLA_KV_BYTES = _kv_exercise()


def check_mla_bytes(latent_bytes, kv_bytes) -> Feedback:
    """Exercise 09.1: DeepSeek-V2's bytes per token in bf16, as latents and as decompressed per-head K/V."""
    return check_parts(("latent cache", MLA_LATENT_BYTES, latent_bytes), ("per-head K/V", MLA_KV_BYTES, kv_bytes))


ABSORB_HINTS = [
    "Head h's score against a cached latent c is q_nope[h] . (W_uk[h] c) = (W_uk[h]^T q_nope[h]) . c: "
    "move W_uk[h] from every key onto the one query.",
    "For each head h, q_latent[..., h, t, :] = q_nope[..., h, t, :] @ w_uk[h]: a (d_nope,) row times a (d_nope, r) "
    "matrix. The heads line up with w_uk's first axis.",
    "return q_nope @ w_uk   # (B, H, T, d_nope) @ (H, d_nope, r) broadcasts to (B, H, T, r); "
    "or torch.einsum('bhtd,hdr->bhtr', q_nope, w_uk)",
]
MODEL_SIZES = dict(q_heads=4, qk_nope_head_dim=8, kv_lora_rank=12)  # the model the checker runs fn in


def check_absorb_query(fn) -> Feedback:
    """Exercise 09.2: ``fn(q_nope, w_uk)`` moves queries (B, H, T, d_nope) into latent space (B, H, T, r).

    ``w_uk`` (H, d_nope, r) is every head's key up-projection. Checked on random inputs
    against the rule, then inside a model: with ``fn`` as its absorbed query projection,
    an MLADecoder's absorbed logits must equal its naive ones.
    """
    import torch

    from ..mla import MLAConfig, MLADecoder

    g = torch.Generator().manual_seed(9)
    b, h, t, d, r = 2, 3, 4, 6, 10  # every axis a different size, so a mixed-up axis shows in the shape
    q_nope, w_uk = torch.randn(b, h, t, d, generator=g), torch.randn(h, d, r, generator=g)
    want = torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk)
    call = f"fn(q_nope {tuple(q_nope.shape)}, w_uk {tuple(w_uk.shape)})"
    try:
        out = fn(q_nope.clone(), w_uk.clone())
        if not isinstance(out, torch.Tensor):
            what = "None" if out is None else f"a {type(out).__name__}"
            return Feedback(False, f"{call} returned {what}; expected a tensor of shape {tuple(want.shape)}.")
        if out.dtype != q_nope.dtype:
            return Feedback(False, f"{call} returned {out.dtype}; keep the queries' dtype, {q_nope.dtype}: attention "
                                   f"needs queries and latents in one dtype (drop the .double() / .half() / .to(...)).")
        out = out.detach().cpu()
    except Exception as err:  # noqa: BLE001 - a learner's code may raise anything
        return raised(call, err, ABSORB_HINTS[1])
    if tuple(out.shape) != tuple(want.shape):
        got = tuple(out.shape)
        if got[-1] == d:
            why = "the last axis is still d_nope: the result must live in the latent space, r values wide."
        elif got == (b, t, h, r):
            why = "heads and tokens are swapped: keep the (B, H, T, r) layout of the queries."
        else:
            why = f"expected (B, H, T, r) = {tuple(want.shape)}."
        return Feedback(False, f"{call} has shape {got}: {why} Hint: {ABSORB_HINTS[1]}")
    if not torch.allclose(out, want, rtol=1e-4, atol=1e-4):
        same_head = torch.einsum("bhtd,dr->bhtr", q_nope, w_uk[0])
        summed = torch.einsum("bhtd,dr->bhtr", q_nope, w_uk.sum(0))
        if torch.allclose(out, same_head, rtol=1e-4, atol=1e-4):
            why = "every head used head 0's matrix: head h needs its own w_uk[h]."
        elif torch.allclose(out, summed, rtol=1e-4, atol=1e-4):
            why = "the heads' matrices were summed: head h needs only its own w_uk[h]."
        elif torch.allclose(out * (d + 4) ** 0.5, want, rtol=1e-3, atol=1e-3) or torch.allclose(out * d**0.5, want, rtol=1e-3, atol=1e-3):
            why = "the result is scaled: the 1/sqrt(d) of the scores is applied once, inside attention, not here."
        else:
            worst = float((out - want).abs().max())
            why = f"the values differ from W_uk[h]^T q_nope[h] by up to {worst:.3g}."
        return Feedback(False, f"{call} gives the right shape but wrong values: {why} Hint: {ABSORB_HINTS[0]}")
    # In a model: with this absorption, absorbed attention must give the naive logits.
    model = MLADecoder(MLAConfig(vocab_size=40, hidden_size=32, qk_rope_head_dim=4, v_head_dim=8, mlp_hidden=48, seed=5,
                                 **MODEL_SIZES)).eval()
    ids = torch.randint(40, (1, 9), generator=g)
    with torch.inference_mode():
        model.decode = "naive"
        naive = model(ids)
        model.decode = "absorbed"
        for block in model.blocks:
            attn = block.attn
            attn.absorb_query = lambda q, attn=attn: fn(q.clone(), attn.up_weights()[0].clone())
        try:
            absorbed = model(ids)
        except Exception as err:  # noqa: BLE001
            absorbed = err
    sizes = ", ".join(f"{k} {v}" for k, v in MODEL_SIZES.items())
    if isinstance(absorbed, Exception):
        return Feedback(False, f"Right on the random inputs, but inside a model ({sizes}) it raised "
                               f"{type(absorbed).__name__}: {str(absorbed).rstrip('.')}. Does fn assume fixed sizes? "
                               f"Read them from q_nope.shape and w_uk.shape.")
    diff = float((absorbed - naive).abs().max())
    if diff > 1e-4:
        return Feedback(False, f"Right on the random inputs, but inside a model ({sizes}) the absorbed logits differ from "
                               f"the naive ones by {diff:.3g}. Does fn use anything besides its two arguments (a global, "
                               f"a fixed size)?")
    return Feedback(True, f"Correct: q_latent[h] = W_uk[h]^T q_nope[h]. In a model, absorbed attention with your function "
                          f"gives the naive logits (largest difference {diff:.1e}), while reading only the "
                          f"{model.config.latent_dim}-value latents instead of {model.config.q_heads} heads' keys and values.")

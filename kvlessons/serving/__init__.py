"""A serving engine in miniature (lesson 11), and the same knobs in the tools learners will use.

One concept per module:

- ``engine``: continuous batching over one paged pool (one batched forward pass per
  step, chunked prefill, prefix reuse across turns, preemption);
- ``speculative``: speculative decoding with a cheap draft and rollback by cropping;
- ``capacity``: how many KV-cache blocks, tokens and concurrent sequences an engine of
  vLLM's design leaves on a GPU after weights and activations;
- ``hf_caches``: transformers' cache classes on SmolLM2, beside their kvlessons equivalents.
"""

from .capacity import ENGINE_KNOBS, EngineCapacity, capacity_from_budget, engine_capacity
from .engine import Engine, RequestRecord, StepRecord, batched_forward
from .speculative import FirstLayers, ModelDraft, PromptLookupDraft, SpeculativeRun, accepted_count, speculative_generate, verify

__all__ = [
    "ENGINE_KNOBS", "Engine", "EngineCapacity", "FirstLayers", "ModelDraft", "PromptLookupDraft", "RequestRecord",
    "SpeculativeRun", "StepRecord", "accepted_count", "batched_forward", "capacity_from_budget", "engine_capacity",
    "speculative_generate", "verify",
]

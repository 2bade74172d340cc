"""The scaffold of lesson 01's "write the cache yourself": a small, self-contained decoder with no cache."""

import ast
import inspect
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from kvlessons import scaffold
from kvlessons.rope import apply_rope, rope_tables

LESSON = Path(__file__).resolve().parents[1] / "notebooks" / "01_why_caching_works.ipynb"
# The three places the model calls a cache, as lesson 01 shows them to the learner.
HOOKS = [
    "positions, mask = cache.positions_and_mask(t)",
    "k, v = cache.update(index, k, v, cos, sin)",
    "cache.advance(t)",
]


def _ids(batch, length, seed=0):
    return torch.randint(96, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_imports_nothing_from_the_rest_of_kvlessons():
    """The learner reads one file: the scaffold imports only the standard library and torch."""
    tree = ast.parse(inspect.getsource(scaffold))
    modules = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert modules and all(m.split(".")[0] in {"__future__", "math", "dataclasses", "torch"} for m in modules), modules


def test_the_lesson_shows_the_hooks_the_model_calls():
    """Each cache call the lesson quotes is a line of the scaffold's source, and the lesson quotes all three."""
    source = inspect.getsource(scaffold)
    lesson = "".join("".join(c["source"]) for c in json.loads(LESSON.read_text())["cells"] if c["cell_type"] == "markdown")
    for line in HOOKS:
        assert line in source and line in lesson, line


def test_the_model_calls_the_cache_once_per_pass_and_once_per_layer():
    """positions_and_mask, then update for layers 0..L-1 in order, then advance: per pass, with the pass's t."""
    calls = []

    class Recorder:
        def __init__(self):
            self.held = 0

        def positions_and_mask(self, t):
            calls.append(("positions_and_mask", t))
            return torch.arange(self.held, self.held + t), torch.ones(t, self.held + t, dtype=torch.bool).tril(self.held)

        def update(self, index, k, v, cos, sin):
            calls.append(("update", index, k.shape[2], cos.shape))
            return scaffold.rotate(k, cos, sin), v  # only what this pass needs: the test is about the calls

        def advance(self, t):
            calls.append(("advance", t))
            self.held += t

    model = scaffold.TinyModel()
    with torch.no_grad():
        model(_ids(1, 4), cache=Recorder())
    layers, d = model.config.layers, model.config.head_dim
    assert calls == [("positions_and_mask", 4)] + [("update", i, 4, (4, d)) for i in range(layers)] + [("advance", 4)]


def test_uncached_is_causal():
    """Without a cache, appending tokens does not change the logits of the ones before."""
    model = scaffold.TinyModel()
    ids = _ids(2, 10)
    with torch.no_grad():
        torch.testing.assert_close(model(ids[:, :6]), model(ids)[:, :6], atol=1e-5, rtol=1e-5)


def test_weights_depend_only_on_the_seed_and_leave_the_global_generator_alone():
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a, b = scaffold.TinyModel(), scaffold.TinyModel()
    assert torch.equal(torch.rand(3), before)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    other = scaffold.TinyModel(scaffold.ScaffoldConfig(seed=1))
    assert not torch.equal(a.embed.weight, other.embed.weight)


def test_rope_is_the_courses_rope():
    """scaffold.rotate with scaffold.rope_tables turns vectors exactly as kvlessons.rope does (Llama's layout)."""
    x = torch.randn(2, 3, 5, 8)
    positions = torch.tensor([0, 1, 7, 30, 500])
    torch.testing.assert_close(scaffold.rotate(x, *scaffold.rope_tables(positions, 8)),
                               apply_rope(x, *rope_tables(positions, 8)))


def test_scores_depend_on_distance_only():
    """A rotated query and key score the same at positions (p, p - 3) for any p: why positions must continue."""
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(pq, pk):
        rq = scaffold.rotate(q, *scaffold.rope_tables(torch.tensor([pq]), 8))
        rk = scaffold.rotate(k, *scaffold.rope_tables(torch.tensor([pk]), 8))
        return (rq * rk).sum()

    torch.testing.assert_close(score(5, 2), score(40, 37))
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_attention_is_sdpa_with_gqa():
    """scaffold.attention equals PyTorch's scaled_dot_product_attention with enable_gqa and a bool mask."""
    q, k, v = torch.randn(2, 6, 3, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    mask = torch.ones(3, 7, dtype=torch.bool).tril(diagonal=4)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(scaffold.attention(q, k, v, mask), want)
    additive = torch.zeros(3, 7).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(scaffold.attention(q, k, v, additive), want)


def test_runs_on_the_device(dev):
    """The model moves to the device; positions and masks built on the CPU follow the ids there."""
    model = scaffold.TinyModel().to(dev)
    ids = _ids(1, 5).to(dev)
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (1, 5, 96) and logits.device.type == torch.device(dev).type
    torch.testing.assert_close(logits.cpu(), scaffold.TinyModel()(ids.cpu()).detach(), atol=1e-4, rtol=1e-4)

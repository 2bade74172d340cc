"""Bytes a cache really holds, measured from its tensors: what the formula must predict (every lesson that counts memory)."""

from __future__ import annotations

import torch


def measured_bytes(obj) -> int:
    """Bytes of every tensor reachable from ``obj``, each underlying storage counted once.

    Follows attributes, lists, tuples, dicts and dataclass fields (not properties, which
    compute on demand), so it counts what an object *keeps*, whatever its own accounting
    says. A view counts its whole storage: a 2-token slice that pins a 4,096-token tensor
    holds 4,096 tokens of memory. The formulas in this module predict this number; the
    tests check them against it. Lesson 11 measures transformers' caches the same way.
    """
    return storage_bytes(held_tensors(obj))


def _inner_tensors(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The plain tensors inside a tensor subclass (optimum-quanto's packed weights are one), or None for a plain tensor.

    A wrapper subclass has no storage of its own to measure: its bytes are those of
    the tensors it is made of, which ``__tensor_flatten__`` names.
    """
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return None
    names, _ = t.__tensor_flatten__()
    return [getattr(t, name) for name in names]


def held_tensors(obj) -> list:
    """Every plain tensor reachable from ``obj`` (attributes, lists, tuples, dicts, tensor subclasses), each once.

    Walks what an object *keeps*, so it measures any cache, transformers' or
    kvlessons', without trusting the cache's own idea of its size.
    """
    found, seen, stack = [], set(), [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            inner = _inner_tensors(item)
            if inner is None:
                found.append(item)
            else:
                stack.extend(inner)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif hasattr(item, "__dict__") and not isinstance(item, (type, torch.nn.Module)):
            stack.extend(vars(item).values())
    return found


def storage_bytes(tensors, device=None) -> int:
    """Bytes of the storages under ``tensors`` (each counted once; only those on ``device`` if given).

    A slice pins its whole storage, so this is the memory really held.
    """
    seen, total = set(), 0
    for t in tensors:
        if device is not None and t.device != torch.device(device):
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total

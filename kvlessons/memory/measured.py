"""Bytes a cache really holds, measured from its tensors: what the formula must predict (every lesson that counts memory)."""

from __future__ import annotations


def measured_bytes(obj) -> int:
    """Bytes of every tensor reachable from ``obj``, each underlying storage counted once.

    Follows attributes, lists, tuples, dicts and dataclass fields (not properties, which
    compute on demand), so it counts what an object *keeps*, whatever its own accounting
    says. A view counts its whole storage: a 2-token slice that pins a 4,096-token tensor
    holds 4,096 tokens of memory. The formulas in this module predict this number; the
    tests check them against it.
    """
    import torch

    seen_storages: set[tuple[str, int]] = set()
    seen_objects: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen_objects:
            continue
        seen_objects.add(id(item))
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            key = (str(item.device), storage.data_ptr())
            if storage.nbytes() and key not in seen_storages:
                seen_storages.add(key)
                total += storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif hasattr(item, "__dict__") and not isinstance(item, (type, torch.nn.Module)):
            stack.extend(vars(item).values())
    return total

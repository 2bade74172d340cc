"""kvlessons: the tested helpers behind a hands-on course on the transformer KV cache.

Notebooks explain and call; this package computes. Modules, one per idea:
``shape`` (ModelShape), ``attention`` (the mask and the attention call), ``rope``,
``cache`` (the cache interface and its variants), ``model`` (TinyDecoder),
``generate`` (greedy decoding and work counting), ``bench`` (measurements),
``plots`` and ``widgets`` (display only).
"""

from ._device import device, synchronize
from .course.environment import check_environment
from .shape import ModelShape

__all__ = ["ModelShape", "check_environment", "device", "synchronize", "__version__"]
__version__ = "0.1.0"

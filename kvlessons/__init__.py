"""kvlessons: the tested helpers behind a hands-on course on the transformer KV cache.

Notebooks explain and call; this package computes. One concept per module (the README's
package table lists them with the lessons that use them): ``shape``, ``attention``,
``rope``, ``cache``, ``model``, ``generate``, ``memory``, ``gqa``, ``crosslayer``, ``fp4``,
``paging``, ``pitfalls``, ``pretrained``, ``scaffold`` (lesson 01's model without a cache),
``exercises`` (the checkers), ``bench`` (measurements), ``plots`` and ``widgets`` (display
only); ``course`` holds the tooling that runs the course rather than what it teaches.
"""

from ._device import device, synchronize
from .course.environment import check_environment
from .shape import ModelShape

__all__ = ["ModelShape", "check_environment", "device", "synchronize", "__version__"]
__version__ = "0.1.0"

"""Bounds of the model configs: sizes a model can have, checked before anything is built.

Upper bounds are far above any trained model (the largest have ~130 layers and hidden sizes of
~25k) and keep a typo such as layers=1000000 from building a million modules, even on meta.
"""

from __future__ import annotations

import math

from autopar.errors import AutoparError

MAX_LAYERS = 1024
MAX_SIZE = 2**24


def check_sizes(family: str, config, *, required: tuple[str, ...], optional: tuple[str, ...]) -> None:
    """`required` sizes are integers >= 1; `optional` ones >= 0, where 0 means the family's
    default; layers at most MAX_LAYERS, every other size at most MAX_SIZE."""
    for name in required + optional:
        value = getattr(config, name)
        smallest = 1 if name in required else 0
        largest = MAX_LAYERS if name == "layers" else MAX_SIZE
        if not isinstance(value, int) or isinstance(value, bool) or not smallest <= value <= largest:
            default = " (0 means the default)" if name in optional else ""
            raise AutoparError(f"{family} {name}={value!r} must be an integer from {smallest} to "
                               f"{largest}{default}")


def check_positive(family: str, config, names: tuple[str, ...]) -> None:
    """Finite floats above 0 (a rotary base, a norm's epsilon)."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
            raise AutoparError(f"{family} {name}={value!r} must be a finite number above 0")

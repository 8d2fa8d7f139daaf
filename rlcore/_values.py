"""Checks of plain values (names, numbers): torch-free, so the config dataclasses that use them
(:mod:`rlcore.loss_config`, :mod:`rlcore.advantage_config`) load without torch."""

import math
from collections.abc import Iterable


def check_choice(name: str, value: str, choices: Iterable[str]) -> str:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(map(repr, choices))}")
    return value


def check_positive(name: str, value: float) -> float:
    """A finite real number > 0 (epsilons that guard a division)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_unit_interval(name: str, value: float) -> float:
    """A real number in [0, 1] (discount factors)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def check_non_negative(name: str, value: float) -> float:
    """A finite real number >= 0 (coefficients and epsilons)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)

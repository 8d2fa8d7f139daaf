"""Types and bounds of the settings, checked by one strict pydantic schema built from the fields (built on first
use: ``--help`` needs none of it), and YAML's numbers-as-text converted by its lax mode.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Mapping
from typing import Any, Literal

from runtime.config.schema import _SPECS, _unwrap_optional, flag


@functools.cache
def _schema(*, strict: bool) -> Any:
    """pydantic's validator of the flat settings (every field by name, with its declared type): strict, the type check
    (no bool for an int, no text for a number); lax, over the float fields only, the conversion of YAML's numbers that
    arrive as text. Built on first use (one schema for all fields: one per field took ~10x longer); ``--help``
    needs neither."""
    from pydantic import ConfigDict, TypeAdapter
    from typing_extensions import TypedDict  # pydantic's TypedDict support needs this one below Python 3.12

    fields = {
        name: _constrained(tp, f.metadata.get("bounds")) if strict else tp
        for name, (_, f, tp) in _SPECS.items()
        if strict or _unwrap_optional(tp)[0] is float
    }
    flat = TypedDict("FlatConfig", fields, total=False)
    flat.__pydantic_config__ = ConfigDict(strict=strict)
    return TypeAdapter(flat)


def _constrained(tp: Any, bounds: Mapping[str, float] | None) -> Any:
    """``tp`` with a field's declared bounds as pydantic constraints on its number (``X | None`` keeps None free)."""
    if not bounds:
        return tp
    from typing import Annotated

    from pydantic import Field

    inner, optional = _unwrap_optional(tp)
    number = Annotated[inner, Field(**bounds)]
    return number | None if optional else number


# How a bound reads in a message: ``gt=0`` -> "> 0"; both ends -> an interval.
_BOUND_WORDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
_LOWER_BRACKET, _UPPER_BRACKET = {"gt": "(", "ge": "["}, {"lt": ")", "le": "]"}


def _bounds_text(bounds: Mapping[str, float]) -> str:
    lower = [(k, v) for k, v in bounds.items() if k in _LOWER_BRACKET]
    upper = [(k, v) for k, v in bounds.items() if k in _UPPER_BRACKET]
    if lower and upper:
        (lk, lv), (uk, uv) = lower[0], upper[0]
        return f"in {_LOWER_BRACKET[lk]}{lv:g}, {uv:g}{_UPPER_BRACKET[uk]}"
    return " and ".join(f"{_BOUND_WORDS[k]} {v:g}" for k, v in bounds.items())


# pydantic's error types of a declared bound (the value has the right type, out of range).
_BOUND_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal"})


def _type_problems(values: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """``(type problems, bound problems)``: a message for each of ``values`` (field name -> value) that does not fit
    its field's type, and for each out of its declared bounds (pydantic decides both)."""
    from pydantic import ValidationError

    try:
        _schema(strict=True).validate_python(dict(values))
    except ValidationError as err:
        kinds: dict[str, bool] = {}
        for e in err.errors():
            if e["loc"]:
                kinds[e["loc"][0]] = kinds.get(e["loc"][0], True) and e["type"] in _BOUND_ERRORS
        types = [_type_message(name, values[name]) for name, bound in kinds.items() if not bound]
        return types, [_type_message(name, values[name]) for name, bound in kinds.items() if bound]
    return [], []


def _type_message(name: str, value: Any) -> str:
    inner, _ = _unwrap_optional(_SPECS[name][2])
    bounds = _SPECS[name][1].metadata.get("bounds")
    if bounds and isinstance(value, int | float) and not isinstance(value, bool):
        return f"{flag(name)} must be {_bounds_text(bounds)}, got {value!r}"
    if value is None:
        return f"{flag(name)} must be set (got None)"
    if typing.get_origin(inner) is Literal:
        return f"{flag(name)} must be one of {', '.join(map(str, typing.get_args(inner)))}; got {value!r}"
    if typing.get_origin(inner) is list:
        return f"{flag(name)} must be a list of {typing.get_args(inner)[0].__name__}, got {value!r}"
    return f"{flag(name)} must be a {inner.__name__}, got {type(value).__name__} {value!r}"


def _coerce(name: str, value: Any) -> Any:
    """Lenient conversions for YAML input, by pydantic's lax mode: ints and numeric strings (YAML 1.1 reads ``1e-6``
    as text) to floats. Other fields, and values it cannot convert, are left for the type check to report."""
    from pydantic import ValidationError

    inner, _ = _unwrap_optional(_SPECS[name][2])
    if inner is not float or isinstance(value, bool) or value is None:
        return value
    try:
        return _schema(strict=False).validate_python({name: value})[name]
    except ValidationError:
        return value

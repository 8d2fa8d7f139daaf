"""How a setting is declared, wherever it is declared: the field metadata every section of the config and every
plug-in's options module (a training backend's, an engine's) uses, and the flag name of a field.

A leaf module (it imports nothing of the runtime): the plug-ins' options modules import it, and ``runtime.config``
composes their dataclasses into its sections, so neither imports the other at load time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SlimeRow:
    """How slime has a field's flag (``runtime.slime_flags`` generates its table from these): slime's argument group
    and default, and where rlcore differs (``differs``: the note; None: as slime, with an optional ``note``)."""

    group: str
    default: Any
    differs: str | None = None
    note: str = ""


def slime(group: str, default: Any, *, differs: str | None = None, note: str = "") -> SlimeRow:
    """A field's row of slime's flag table: ``slime("rollout", 1, differs="...")``."""
    return SlimeRow(group, default, differs, note)


def described(
    text: str, *, own: str | None = None, slime: SlimeRow | None = None, megatron: bool = False
) -> dict[str, Any]:
    """Metadata of a field: its ``--help`` text; for a plug-in's own field ``own``, what it is (the refusal under
    another plug-in names it: ``--adam-beta2: a Megatron flag, used by --train-backend megatron only``); for a flag
    slime has, ``slime``, its row of slime's flag table; ``megatron``: a flag of Megatron-LM's (its name and
    meaning) that more than the Megatron backend reads, so it is declared in a section, not in
    ``megatron_options.MegatronOptions`` (``runtime.slime_flags.MEGATRON_PARSED`` lists it)."""
    meta: dict[str, Any] = {"help": text}
    if own is not None:
        meta["own"] = own
    if slime is not None:
        meta["slime"] = slime
    if megatron:
        meta["megatron"] = True
    return meta


def bounded(*, help: str, own: str | None = None, slime: SlimeRow | None = None, **bounds: float) -> dict[str, Any]:
    """Metadata of a number field with bounds (``gt``, ``ge``, ``lt``, ``le``): the type check enforces them
    (pydantic's constraints; None, where the field allows it, is exempt) and a value out of them is reported as
    ``--flag must be > 0, got 0``."""
    return {**described(help, own=own, slime=slime), "bounds": bounds}


def hook(text: str, *, own: str | None = None, slime: SlimeRow | None = None) -> dict[str, Any]:
    """Metadata of a hook flag: validation resolves it (``runtime.hooks.resolve_hook``) before anything starts."""
    return {**described(text, own=own, slime=slime), "hook": True}


def flag(name: str) -> str:
    """The command-line flag of a field: ``rollout_batch_size`` -> ``--rollout-batch-size``."""
    return "--" + name.replace("_", "-")


def own_fields(*options: type) -> dict[str, str]:
    """The fields the options dataclasses ``options`` declare (a plug-in's own, which no other plug-in reads) ->
    what each is: its ``own`` metadata, else the class's ``OWN`` text. Derived from the declarations, so a field
    added to a plug-in's options is its own with no list to keep."""
    return {f.name: f.metadata.get("own") or cls.OWN for cls in options for f in dataclasses.fields(cls)}


class registry_view(Mapping[str, Any]):  # noqa: N801 - used as a function: registry_view(registry, field)
    """A live, read-only ``name -> entry.<field>`` view of a plug-in registry (``{name: entry}``): a registry's one
    line per plug-in names its class and its options module, and the options registries are views of it, so a
    plug-in added to the registry (even after this module is imported) is in the view too."""

    def __init__(self, registry: Mapping[str, Any], field: str) -> None:
        self._registry, self._field = registry, field

    def __getitem__(self, name: str) -> Any:
        return getattr(self._registry[name], self._field)

    def __iter__(self) -> Iterator[str]:
        return iter(self._registry)

    def __len__(self) -> int:
        return len(self._registry)

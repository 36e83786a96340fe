"""How a config field is declared: its default, help text and marks (the choices titanlite takes,
TorchTitan keys it does not implement, its own extensions). --help and the readers use the marks."""

from __future__ import annotations

from dataclasses import field

def opt(
    default,
    help: str,
    choices: tuple | None = None,
    *,
    not_implemented: str | None = None,
    unsupported: dict | None = None,
    extension: bool = False,
):
    """A config field with its help text.

    choices: the allowed values (of each item, for a list); unsupported: those of them titanlite does
    not implement, each with what to use instead; not_implemented: the key is accepted only at its
    default, and this says what to use instead; extension: a titanlite key that TorchTitan lacks."""
    meta = dict(help=help, choices=choices, not_implemented=not_implemented, unsupported=unsupported or {}, extension=extension)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def choices_text(meta) -> str:
    """' (one of: a, b)' for a field whose values are listed (less the unsupported ones), else ''."""
    choices = [c for c in meta["choices"] or () if c not in meta["unsupported"]]
    return f" (one of: {', '.join('none' if c is None else str(c) for c in choices)})" if choices else ""


def section(cls):
    return field(default_factory=cls)


# What to use instead, for keys whose feature titanlite lacks.
NO_MOE = "titanlite's MoE family does not have it yet"
NO_MX = "MX formats are not implemented; use model.converters = [\"float8\"]"

"""A resolved config as TOML text: what JobConfig.save writes and --help shows as defaults."""

from __future__ import annotations

import json


def toml_text(values: dict) -> str:
    """TOML of a config's nested dict (none values are left out: absent keys take their default)."""
    lines = []
    for name, table in _tables(values):
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {toml_value(v)}" for k, v in table.items() if v is not None)
        lines.append("")
    return "\n".join(lines)


def _tables(values: dict, prefix: str = ""):
    """(dotted section name, its plain values) for every section, nested ones after their parent."""
    plain = {k: v for k, v in values.items() if not isinstance(v, dict)}
    if prefix:
        yield prefix, plain
    for k, v in values.items():
        if isinstance(v, dict):
            yield from _tables(v, f"{prefix}.{k}" if prefix else k)


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # strings and (nested) lists of scalars are valid TOML in JSON syntax

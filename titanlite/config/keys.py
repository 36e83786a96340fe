"""The schema's keys: every dotted key and section, their defaults, old names (MOVED) and the
closest key to a misspelled one."""

from __future__ import annotations

import dataclasses
import difflib
import typing

from titanlite.config.schema import JobConfig
from titanlite.errors import ConfigError

# Names of older titanlite (and older TorchTitan) configs, and where TorchTitan v0.2.2 keeps them.
MOVED = {
    "float8.enable": 'model.converters = ["float8"]',
    **{f"float8.{k}": f"quantize.linear.float8.{k}" for k in (
        "recipe_name", "enable_fsdp_float8_all_gather", "precompute_float8_dynamic_scale_for_fsdp", "filter_fqns", "emulate")},
    "training.seed": "debug.seed",
    "training.deterministic": "debug.deterministic",
    "job.dry_run": 'comm.mode = "fake_backend"',
    "parallelism.mixed_precision_param": "training.mixed_precision_param",
    "parallelism.mixed_precision_reduce": "training.mixed_precision_reduce",
}


def is_section(f: dataclasses.Field) -> bool:
    return f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)


def default_value(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def leaves(cls=JobConfig, prefix: str = ""):
    """(dotted key, field, owning section class) of every value in the schema, in order."""
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if is_section(f):
            yield from leaves(f.default_factory, key + ".")
        else:
            yield key, f, cls


LEAVES = {key: (f, owner) for key, f, owner in leaves()}
SECTIONS = {".".join(key.split(".")[:n]) for key in LEAVES for n in range(1, key.count(".") + 1)}


def closest(name: str, candidates) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else ""


def check_key(key: str) -> str:
    """The key itself if the schema has it; else ConfigError naming its new place or a close key."""
    if key in LEAVES:
        return key
    if key in MOVED:
        raise ConfigError(f"config key '{key}' is not in the TorchTitan v0.2 schema titanlite uses; use {MOVED[key]}")
    if key in SECTIONS:
        raise ConfigError(f"'{key}' is a section, not a key; set its keys ([{key}] key = value)")
    section = key.rsplit(".", 1)[0] if "." in key else key
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section [{section}]{closest(section, SECTIONS)} (run with --help for all keys)")
    raise ConfigError(f"unknown config key '{key}'{closest(key, LEAVES)} (run with --help for all keys)")


def field_type(key: str):
    f, owner = LEAVES[key]
    return typing.get_type_hints(owner)[f.name]


def get(config: JobConfig, key: str):
    owner = config
    for part in key.split("."):
        owner = getattr(owner, part)
    return owner

"""Reading a config: the TOML file, `--section.key value` overrides, coercion to each key's type,
choices, and --help (its text: help.py).

Precedence: CLI `--section.key value` > TOML file (`--job.config_file`) > dataclass defaults.
Bad input raises ConfigError, which the entry points turn into one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import os
import sys
import types
import typing

from titanlite.config.help import help_text
from titanlite.config.keys import LEAVES, SECTIONS, check_key, closest, default_value, field_type, get
from titanlite.config.schema import JobConfig
from titanlite.config.validation import validate
from titanlite.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def _value_types(tp) -> tuple[list, bool]:
    """(the non-None types of a field's annotation, whether None is allowed)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = typing.get_args(tp)
        return [a for a in args if a is not type(None)], type(None) in args
    return [tp], False


def _coerce(tp, value):
    """`value` (TOML or a CLI string) as type `tp`; ValueError if it is not one."""
    origin = typing.get_origin(tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
    elif tp is int:
        if not isinstance(value, bool) and not (isinstance(value, float) and not value.is_integer()):
            return int(value)
    elif tp is float:
        if not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            nested = typing.get_origin(item_tp) is list
            value = json.loads(value) if nested else [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list):
            return [_coerce(item_tp, v) for v in value]
    raise ValueError


def _convert(key: str, value):
    """Coerce a TOML value or CLI string to the field's type; raise ConfigError naming key, value and type."""
    candidates, optional = _value_types(field_type(key))
    if optional and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
        return None
    for tp in candidates:
        try:
            return _coerce(tp, value)
        except (TypeError, ValueError):
            continue
    type_name = " or ".join(str(tp).replace("typing.", "") if typing.get_origin(tp) else tp.__name__ for tp in candidates)
    raise ConfigError(f"{key}={value!r} is not a valid {type_name}{' or none' if optional else ''}")


def _check_choices(key: str, value) -> None:
    f, _ = LEAVES[key]
    choices, unsupported = f.metadata["choices"], f.metadata["unsupported"]
    if not choices:
        return
    for item in value if isinstance(value, list) else [value]:
        shown = "none" if item is None else repr(item)
        if item not in choices:
            allowed = ", ".join("none" if c is None else str(c) for c in choices if c not in unsupported)
            raise ConfigError(f"{key}={value!r}: {shown} is not allowed; choose from: {allowed}")
        if item in unsupported:
            raise ConfigError(f"{key}={value!r}: {shown} is not implemented in titanlite; {unsupported[item]}")


def _assign(config: JobConfig, key: str, raw) -> None:
    key = check_key(key)
    value = _convert(key, raw)
    _check_choices(key, value)
    section, name = key.rsplit(".", 1)
    setattr(get(config, section), name, value)


def load_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"job.config_file='{path}' does not exist; pass an existing TOML file (see train_configs/)")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"job.config_file='{path}' is not valid TOML: {e}")
    except OSError as e:  # a folder, a file that cannot be read
        raise ConfigError(f"job.config_file='{path}' cannot be read ({e.strerror or e}); pass a TOML file (see train_configs/)")


def toml_pairs(table: dict, prefix: str = "") -> list[tuple[str, object]]:
    """Dotted keys and values of a parsed TOML file; nested tables are nested sections."""
    pairs = []
    for k, v in table.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key not in LEAVES:
            if not v and key not in SECTIONS:
                raise ConfigError(f"unknown config section [{key}]{closest(key, SECTIONS)} (run with --help for all keys)")
            pairs += toml_pairs(v, key + ".")  # its keys name a section, an old name (MOVED) or a near miss
        elif not prefix:
            raise ConfigError(f"top-level key '{k}' in the TOML file must be a [section] table")
        else:
            pairs.append((key, v))
    return pairs


def _split_cli(argv: list[str]) -> list[tuple[str, object]]:
    """`--section.key value`, `--section.key=value`, bare boolean `--section.key` and TorchTitan's
    `--section.no_key` (false) -> (dotted key, value) pairs."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument '{arg}'; overrides look like --section.key value (see --help)")
        name, eq, value = arg[2:].partition("=")
        section, _, leaf = name.rpartition(".")
        leaf = leaf.replace("-", "_")
        key = f"{section}.{leaf}"
        negated = f"{section}.{leaf[3:]}"
        if key not in LEAVES and leaf.startswith("no_") and not eq and negated in LEAVES and field_type(negated) is bool:
            pairs.append((negated, False))
            i += 1
            continue
        key = check_key(key)
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if field_type(key) is bool and (nxt is None or nxt.startswith("--")):
                value = True
            elif nxt is None:
                raise ConfigError(f"--{key} needs a value")
            else:
                value, i = nxt, i + 1
        pairs.append((key, value))
        i += 1
    return pairs


def _help_request(argv: list[str]) -> tuple[list[str], str | None]:
    """(argv without `--help [WORD]`, WORD: '' for a bare --help; None without --help). WORD is the
    argument after --help unless that is an override (--section.key)."""
    at = next((i for i, arg in enumerate(argv) if arg in ("--help", "-h")), None)
    if at is None:
        return argv, None
    word = argv[at + 1] if at + 1 < len(argv) and not argv[at + 1].startswith("-") else ""
    return argv[:at] + argv[at + 1 + bool(word):], word


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Build the JobConfig from defaults, the TOML file named by --job.config_file, and CLI overrides.
    With --help [WORD]: print the help, showing the values they give, and exit 0."""
    argv, query = _help_request(list(sys.argv[1:] if argv is None else argv))
    overrides = _split_cli(argv)
    config = JobConfig()
    config_files = [v for k, v in overrides if k == "job.config_file" and v]
    from_file = dict(toml_pairs(load_toml(str(config_files[-1])))) if config_files else {}
    for key, value in [*from_file.items(), *overrides]:
        _assign(config, key, value)
    _tie_validation_to_training(config, from_file, {key for key, _ in overrides})
    if query is not None:  # before validate: the help shows a config that is not consistent yet too
        given = [str(config_files[-1])] if config_files else []
        given += ["the command line's overrides"] if any(k != "job.config_file" for k, _ in overrides) else []
        text = help_text(config, query, " with ".join(given))
        try:
            print(text, flush=True)
        except BrokenPipeError:  # `--help | head` stopped reading: no traceback, and none at exit's flush
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0)
    validate(config)
    return config


def _tie_validation_to_training(config: JobConfig, from_file: dict, from_cli: set) -> None:
    """Under pipeline parallel the schedule's stages have fixed shapes, so validation batches take
    training's size and length. A validation key follows training's unless the user set it apart: on
    the command line, or in the file to a value other than the file's training value (ParallelDims
    then refuses the mismatch)."""
    if config.parallelism.pipeline_parallel_degree == 1:
        return
    for name in ("local_batch_size", "seq_len"):
        key, training_key = f"validation.{name}", f"training.{name}"
        tied_in_file = from_file.get(key, default_value(LEAVES[key][0])) == from_file.get(training_key, default_value(LEAVES[training_key][0]))
        if key not in from_cli and (key not in from_file or tied_in_file):
            setattr(config.validation, name, getattr(config.training, name))

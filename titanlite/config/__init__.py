"""Job configuration: TorchTitan v0.2.2's JobConfig schema (schema.py), read from a TOML file and
`--section.key value` overrides (reading.py), checked across keys (validation.py).

This package imports no torch, so `run_train.sh` can check a config (titanlite/preflight.py) before
it starts torchrun. Bad input raises ConfigError (titanlite/errors.py): one line on stderr, exit 2.
"""

from titanlite.config.keys import LEAVES, get
from titanlite.config.reading import help_text, load_toml, parse_args
from titanlite.config.quantize import FLOAT8_CONVERTERS, float8_recipe
from titanlite.config.schema import JobConfig
from titanlite.config.validation import validate
from titanlite.errors import ConfigError

__all__ = [
    "FLOAT8_CONVERTERS", "LEAVES", "ConfigError", "JobConfig", "float8_recipe", "get", "help_text", "load_toml",
    "parse_args", "validate",
]

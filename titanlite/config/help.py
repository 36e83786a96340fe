"""--help: the environment variables first, then every key by section (model first, a nested section
right after its parent) with the values the config file and overrides give, then TorchTitan's keys
titanlite does not implement, in one closing list. `--help SECTION` shows one section; `--help WORD`
the keys and variables whose name or help text holds WORD. Lines fit 100 columns."""

from __future__ import annotations

import dataclasses
import textwrap

from titanlite.config.fields import choices_text
from titanlite.config.keys import default_value, get, is_section
from titanlite.config.schema import JobConfig
from titanlite.config.writing import toml_value
from titanlite.errors import ConfigError

WIDTH = 100

# Read by run_train.sh (in the order a person needs them), then by titanlite under any launcher.
ENVIRONMENT = (
    ("CONFIG_FILE", "the TOML config (default train_configs/debug_model.toml)"),
    ("NGPU", "processes per node (default: the GPU count, or 1 without GPUs)"),
    ("NNODES", "nodes (default 1); more than 1 use c10d rendezvous at RDZV_ENDPOINT"),
    ("NODE_RANK", "this node's rank, 0 .. NNODES - 1 (default 0)"),
    ("RDZV_ENDPOINT", "host:port of the rendezvous, the same on every node (needed when NNODES > 1)"),
    ("RDZV_ID", "the rendezvous id, the same on every node (default titanlite)"),
    ("LOG_RANK", "the ranks whose output is shown, e.g. 0 or 0,3 (default 0)"),
    ("COMM_MODE", "fake_backend: a dry run of NGPU x NNODES ranks in one process (sets comm.mode)"),
    ("MAX_RESTARTS", "times torchrun restarts the job after a rank dies (default 0); with checkpoint.enable "
                     "it resumes from the latest checkpoint"),
    ("FT_LIGHTHOUSE", "start: run torchft's Lighthouse here for every replica group, until this group ends"),
    ("FT_LIGHTHOUSE_PORT", "that Lighthouse's port (default 29510)"),
    ("FT_MIN_REPLICAS", "the fewest replica groups that Lighthouse forms a quorum of (default 1)"),
    ("TORCHFT_LIGHTHOUSE", "http://host:port of the Lighthouse, for fault_tolerance.enable (FT_LIGHTHOUSE=start "
                           "sets it)"),
    ("PYTHON", "the interpreter (default .venv/bin/python if present, else python3)"),
    ("OMP_NUM_THREADS", "threads per process (default 1 when NGPU > 1: CPU ranks share the cores)"),
    ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1 (default): each attempt of the job gets a fresh store, so a node "
                                           "that replaces a dead one can rejoin"),
    ("TITANLITE_CACHE", "the built-in Shakespeare corpus's cache (default $XDG_CACHE_HOME/titanlite, else "
                        "~/.cache/titanlite)"),
    ("HF_HUB_OFFLINE", "1: refuse Hugging Face hub datasets at once instead of trying the network "
                       "(also HF_DATASETS_OFFLINE)"),
    ("HF_ENDPOINT", "the hub's address, checked before a hub dataset is streamed (default https://huggingface.co)"),
    ("WANDB_PROJECT", "metrics.enable_wandb: the W&B project (default titanlite); also WANDB_RUN_NAME, "
                      "WANDB_TEAM, WANDB_MODE=offline"),
    ("NO_COLOR", "any value: plain console lines on a terminal too"),
)

# Sections in the order a person sets up a run; any other section follows in the schema's order.
ORDER = (
    "model", "training", "parallelism", "checkpoint", "optimizer", "lr_scheduler", "activation_checkpoint",
    "compile", "quantize", "validation", "metrics", "job", "profiling", "comm", "fault_tolerance", "debug",
    "memory_estimation", "experimental",
)

INTRO = (
    "--help SECTION shows one section (e.g. --help training); --help WORD shows the keys and environment "
    "variables whose name or help text holds WORD (e.g. --help seed).",
    "The schema is TorchTitan v0.2.2's JobConfig. Every key can be set in the TOML file ([section] key = value; "
    "nested sections as [quantize.linear.float8]) or on the command line (--section.key value or "
    "--section.key=value; booleans also as a bare --section.key or --section.no_key; lists comma-separated, "
    "nested lists as JSON). The command line wins over the file, the file over the defaults. A key "
    "TorchTitan lacks is marked [titanlite].",
)


def _wrap(text: str, indent: str, later: str | None = None) -> list[str]:
    later = indent if later is None else later
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=later, break_on_hyphens=False)


def sections() -> list[tuple[str, list[tuple[str, dataclasses.Field]]]]:
    """(section, its own keys) in help order; a section without keys of its own ([quantize]) has no entry."""

    def walk(cls, name: str) -> list:
        fields = dataclasses.fields(cls)
        own = [(f"{name}.{f.name}", f) for f in fields if not is_section(f)]
        nested = [s for f in fields if is_section(f) for s in walk(f.default_factory, f"{name}.{f.name}")]
        return ([(name, own)] if own else []) + nested

    tops = sorted(dataclasses.fields(JobConfig), key=lambda f: ORDER.index(f.name) if f.name in ORDER else len(ORDER))
    return [s for f in tops for s in walk(f.default_factory, f.name)]


def _description(f: dataclasses.Field) -> str:
    meta = f.metadata
    return f"{'[titanlite] ' if meta['extension'] else ''}{meta['help']}{choices_text(meta)}"


def _shown(value) -> str:
    return "none" if value is None else toml_value(value)


def _entry(key: str, f: dataclasses.Field, config: JobConfig, mark: bool) -> list[str]:
    """`  --key = value` (`* --key = value  (default d)` when it differs from the default), then its help."""
    value, default = get(config, key), default_value(f)
    changed = mark and value != default
    head = f"--{key} = {_shown(value)}" + (f"  (default {_shown(default)})" if changed else "")
    return _wrap(head, "* " if changed else "  ", " " * 8) + _wrap(_description(f), " " * 6)


def _matches(word: str, *texts: str) -> bool:
    return any(word in text.lower() for text in texts)


def help_text(config: JobConfig | None = None, query: str = "", values_from: str = "") -> str:
    """The help for `--help [query]`; `values_from` says where the config's values came from (a file,
    overrides), and its values other than the defaults are marked. ConfigError when nothing matches."""
    config = config or JobConfig()
    word = query.lower()
    in_section = [(name, keys) for name, keys in sections() if word and (name == word or name.startswith(word + "."))]
    if not word:
        chosen, environment = sections(), list(ENVIRONMENT)
    elif in_section:
        chosen, environment = in_section, []
    else:  # the keys and variables whose name or help text holds the word
        chosen = [(name, [(k, f) for k, f in keys if _matches(word, k, f.metadata["help"])]) for name, keys in sections()]
        environment = [(n, m) for n, m in ENVIRONMENT if _matches(word, n, m)]
    refused = [(k, f) for _, keys in chosen for k, f in keys if f.metadata["not_implemented"]]
    chosen = [(name, [(k, f) for k, f in keys if not f.metadata["not_implemented"]]) for name, keys in chosen]
    chosen = [(name, keys) for name, keys in chosen if keys]
    if not (chosen or environment or refused):
        tops = ", ".join(dict.fromkeys(name.split(".")[0] for name, _ in sections()))
        raise ConfigError(f"--help {query!r}: no section, key or environment variable matches it; sections: {tops}")

    lines = []
    if not word:
        lines += ["usage: ./run_train.sh [--section.key value ...] [--help [SECTION | WORD]]",
                  "       python -m titanlite.train --job.config_file FILE [--section.key value ...]"]
        for paragraph in INTRO:
            lines += ["", *_wrap(paragraph, "")]
    if environment:
        lines += ["", "Environment variables:"]
        for name, meaning in environment:
            lines += _wrap(meaning, f"  {name:<20} " if len(name) < 20 else f"  {name}  ", " " * 23)
    if chosen and values_from:
        lines += ["", *_wrap(f"Values: {values_from}; * marks a value other than the default.", "")]
    for name, keys in chosen:
        lines += ["", f"[{name}]"]
        for key, f in keys:
            lines += _entry(key, f, config, bool(values_from))
    if refused and not word:
        lines += ["", *_wrap("Not implemented: TorchTitan keys titanlite accepts only at their default (--help KEY "
                             "says what to use instead):", ""), *_wrap(", ".join(k for k, _ in refused), "  ")]
    elif refused:
        lines += ["", "Not implemented: TorchTitan keys titanlite accepts only at their default:"]
        for key, f in refused:
            lines += _wrap(f"{key}: {f.metadata['help']}; {f.metadata['not_implemented']}", "  ", " " * 6)
    return "\n".join(lines).strip("\n")

"""Job configuration: one dataclass per TOML section, TorchTitan v0.2 names.

Precedence: CLI `--section.key value` > TOML file (`--job.config_file`) > dataclass defaults.
Bad input raises ConfigError, which the entry points turn into one line on stderr and exit code 2.
This module imports no torch, so `run_train.sh` can check a config (titanlite/preflight.py) before
it starts torchrun.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from titanlite.models.args import LLAMA3_FLAVORS

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the key, the value and the fix."""


def opt(default, help: str, choices: tuple | None = None):
    """A config field with its help text (and allowed values, checked at load time)."""
    meta = {"help": help, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Job:
    config_file: str = opt("", "TOML file to load; CLI overrides win over it")
    dump_folder: str = opt("./outputs", "run folder: metrics.jsonl, TensorBoard, checkpoints, resolved config")
    description: str = opt("titanlite training run", "free text, printed at start")
    dry_run: bool = opt(
        False,
        "build the mesh and the parallelized model on the meta device for WORLD_SIZE ranks "
        "in one process (fake collectives), report, and exit without training",
    )


@dataclass
class Model:
    name: str = opt("llama3", "model family", choices=("llama3",))
    flavor: str = opt("debugmodel", "model size preset", choices=tuple(LLAMA3_FLAVORS))
    n_layers: int = opt(0, "transformer blocks; 0 = the flavor's (fewer: a big model's shape on fewer GPUs)")
    tokenizer_path: str = opt(
        "shakespeare-bpe8k",
        "'byte' (no files), 'shakespeare-bpe8k' (bundled), or a tokenizer.json / tiktoken file or a folder holding one",
    )


@dataclass
class Optimizer:
    name: str = opt("AdamW", "optimizer", choices=("AdamW", "Adam"))
    lr: float = opt(8e-4, "peak learning rate")
    eps: float = opt(1e-8, "Adam epsilon")
    beta1: float = opt(0.9, "Adam beta1")
    beta2: float = opt(0.95, "Adam beta2")
    weight_decay: float = opt(0.1, "decoupled weight decay")
    implementation: str = opt(
        "fused", "Adam kernel: fused, foreach or for-loop", choices=("fused", "foreach", "for-loop")
    )


@dataclass
class LRScheduler:
    warmup_steps: int = opt(200, "linear warmup steps")
    decay_ratio: float | None = opt(
        None, "fraction of steps spent decaying at the end (warmup-stable-decay); none = decay right after warmup"
    )
    decay_type: str = opt("linear", "decay curve", choices=("linear", "sqrt", "cosine"))
    min_lr_factor: float = opt(0.0, "final lr as a fraction of the peak lr")


@dataclass
class Training:
    dataset: str = opt(
        "shakespeare",
        "'shakespeare' (built in), a Hugging Face hub dataset name, or a local file/folder/glob "
        "(.jsonl, .jsonl.gz, .parquet, .txt)",
    )
    dataset_path: str = opt("", "local file, folder or glob to read `dataset` from")
    dataset_text_field: str = opt("text", "the column holding the document text")
    data_split: str = opt(
        "documents",
        "how data-parallel ranks split the data: 'documents' (each reads a disjoint part: fast at scale) or "
        "'sequences' (each reads the whole stream and takes its rows of every global batch: the same batches, "
        "and losses, on any layout)",
        choices=("documents", "sequences"),
    )
    local_batch_size: int = opt(8, "sequences per data-parallel rank per microbatch")
    global_batch_size: int = opt(
        -1, "sequences per optimizer step over all ranks; -1 = local_batch_size x dp (no gradient accumulation)"
    )
    seq_len: int = opt(2048, "tokens per sequence")
    max_norm: float = opt(1.0, "gradient-norm clipping threshold; <= 0 disables clipping")
    steps: int = opt(10000, "optimizer steps to train")
    seed: int = opt(
        42, "seed of the initial weights and of torch's RNG; the data order is the dataset's own (not shuffled)"
    )
    deterministic: bool = opt(False, "use deterministic algorithms (slower)")
    mixed_precision_param: str = opt(
        "auto",
        "FSDP parameter dtype for compute: auto (bfloat16 on GPU, float32 on CPU), bfloat16, float32",
        choices=("auto", "bfloat16", "float32"),
    )
    mixed_precision_reduce: str = opt(
        "float32", "dtype of gradient reductions", choices=("float32", "bfloat16")
    )
    gc_freq: int = opt(50, "run Python garbage collection every N steps (automatic GC is off while training)")
    skip_nonfinite_steps: bool = opt(
        False, "skip an optimizer step whose grad norm is NaN or Inf (logged and counted) instead of stopping the run"
    )
    max_skipped_steps: int = opt(10, "with skip_nonfinite_steps: stop the run once more steps than this were skipped")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = opt(1, "replicas (DDP, or HSDP's outer dim)")
    data_parallel_shard_degree: int = opt(-1, "FSDP shards; -1 = the ranks left over")
    tensor_parallel_degree: int = opt(1, "tensor-parallel ranks (innermost mesh dim)")
    pipeline_parallel_degree: int = opt(1, "pipeline-parallel ranks (outermost mesh dim)")
    pipeline_parallel_schedule: str = opt(
        "1F1B",
        "torch.distributed.pipelining schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
        "ZBVZeroBubble, DualPipeV (what the installed torch offers)",
    )
    pipeline_parallel_microbatch_size: int = opt(1, "sequences per pipeline microbatch (local_batch_size must divide by it)")
    pipeline_parallel_layers_per_stage: int = opt(
        -1, "layers per pipeline stage (embedding and output count as one each); -1 = 1 stage per rank, 2 for multi-stage schedules"
    )
    module_fqns_per_model_part: list[str] = opt(
        [], "explicit stages: one string per stage of space-separated module names, e.g. 'tok_embeddings layers.0,layers.1 norm output'"
    )
    context_parallel_degree: int = opt(1, "context-parallel ranks (the sequence split over ranks; ring attention)")
    context_parallel_rotate_method: str = opt(
        "allgather", "how KV shards move around the cp ring", choices=("allgather", "alltoall")
    )
    context_parallel_load_balancer: str = opt(
        "headtail",
        "headtail: rank r holds sequence chunks r and 2cp-1-r, so causal attention work is even; none: contiguous chunks",
        choices=("headtail", "none"),
    )
    fsdp_reshard_after_forward: str = opt(
        "default",
        "free gathered params after forward: default (yes unless PP), always, never",
        choices=("default", "always", "never"),
    )
    enable_sequence_parallel: bool = opt(True, "shard norms and activations along the sequence under TP")
    disable_loss_parallel: bool = opt(False, "gather the logits instead of a vocab-parallel cross entropy under TP")


@dataclass
class Checkpoint:
    enable: bool = opt(False, "save distributed checkpoints and resume from the latest complete one")
    folder: str = opt("checkpoint", "checkpoint folder, inside dump_folder (step-N subfolders)")
    interval: int = opt(500, "save every N steps (and at the last step)")
    keep_latest_k: int = opt(10, "keep the newest k complete checkpoints; 0 = keep all")
    async_mode: str = opt(
        "disabled",
        "disabled; async (write in the background while training goes on); async_with_pinned_mem (async, staging "
        "through pinned memory on CUDA)",
        choices=("disabled", "async", "async_with_pinned_mem"),
    )
    load_step: int = opt(-1, "resume from this step's checkpoint; -1 = the latest complete one")
    initial_load_path: str = opt("", "a checkpoint (step folder) to start from when the run has none of its own")
    initial_load_model_only: bool = opt(True, "from initial_load_path, load only the model weights")
    last_save_model_only: bool = opt(False, "make the final checkpoint model-only (in export_dtype), for export")
    export_dtype: str = opt("float32", "dtype of model-only checkpoints", choices=("float32", "bfloat16", "float16"))
    exclude_from_loading: list[str] = opt([], "parts not to load: model, optimizer, train, dataloader")
    create_seed_checkpoint: bool = opt(
        False, "on 1 process: write the initial weights to <folder>/step-0 for every layout to load, then exit"
    )


@dataclass
class ActivationCheckpoint:
    mode: str = opt("none", "activation checkpointing", choices=("none", "selective", "full"))
    selective_ac_option: str = opt("op", "'op' (per-op policy) or an integer k (every k-th block)")


@dataclass
class Compile:
    enable: bool = opt(False, "torch.compile each transformer block (with TP: its attention and feed_forward)")
    components: list[str] = opt(["model", "loss"], "what to compile: model, loss")


@dataclass
class Float8:
    enable: bool = opt(False, "float8 training of linear layers")
    recipe_name: str = opt("tensorwise", "scaling recipe", choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"))
    enable_fsdp_float8_all_gather: bool = opt(False, "FSDP all-gathers weights in float8 (tensorwise recipe)")
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(
        False, "with float8 all-gather: all weights' scales from one all-reduce per step"
    )
    filter_fqns: list[str] = opt(["output"], "linear layers to keep in high precision (name substrings)")
    emulate: bool = opt(False, "multiply dequantized float8 values in high precision (no float8 matmul hardware)")


@dataclass
class Metrics:
    log_freq: int = opt(10, "log every N steps (and step 1)")
    enable_tensorboard: bool = opt(True, "write TensorBoard event files")
    save_tb_folder: str = opt("tb", "TensorBoard folder, inside dump_folder")
    peak_flops: float = opt(
        0.0, "peak FLOP/s per device for MFU; 0 = look up the GPU, or measure a matmul on CPU"
    )
    gpu_hour_cost: float = opt(0.0, "dollars per device-hour, for the cost per million tokens (0 = not reported)")


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "torch.profiler traces of one step every profile_freq steps, per rank")
    profile_freq: int = opt(10, "trace every N steps (>= 2)")
    save_traces_folder: str = opt("profile_traces", "trace folder, inside dump_folder")
    enable_memory_snapshot: bool = opt(False, "CUDA allocator memory snapshots every profile_freq steps (GPU only)")
    save_memory_snapshot_folder: str = opt("memory_snapshot", "snapshot folder, inside dump_folder")


@dataclass
class Comm:
    init_timeout_seconds: int = opt(300, "timeout of collectives until the first step is done")
    train_timeout_seconds: int = opt(100, "timeout of collectives after the first step (catches hangs sooner)")
    checkpoint_timeout_seconds: int = opt(
        1800, "timeout of the async checkpoint's collectives (writing large shards in the background takes long)"
    )


@dataclass
class Validation:
    enable: bool = opt(False, "evaluate a held-out set during training")
    dataset: str = opt("", "validation dataset; empty = the held-out part of the training dataset")
    dataset_path: str = opt("", "local path for the validation dataset")
    freq: int = opt(100, "evaluate every N steps (and at the last step)")
    steps: int = opt(10, "batches per evaluation")


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    validation: Validation = field(default_factory=Validation)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: Path) -> None:
        """Write the resolved config as TOML-compatible JSON-ish text (TOML needs no writer dependency)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None)
            lines.append("")
        path.write_text("\n".join(lines))


# Keys TorchTitan v0.2 keeps in another section than we do: accepted there too, so its configs load.
ALIASES = {
    ("parallelism", "mixed_precision_param"): ("training", "mixed_precision_param"),
    ("parallelism", "mixed_precision_reduce"): ("training", "mixed_precision_reduce"),
}


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # strings and lists of scalars are valid TOML in JSON syntax


def _sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}


def _fields(section_cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section_cls)}


def _closest(name: str, candidates) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else ""


def _all_keys() -> list[str]:
    return [f"{s}.{k}" for s, cls in _sections().items() for k in _fields(cls)]


def _resolve_key(section: str, key: str) -> tuple[str, str]:
    """Check a section/key pair, following ALIASES; raise ConfigError with a suggestion."""
    section, key = ALIASES.get((section, key), (section, key))
    sections = _sections()
    if section not in sections:
        raise ConfigError(f"unknown config section [{section}]{_closest(section, sections)} (run with --help for all keys)")
    if key not in _fields(sections[section]):
        full = f"{section}.{key}"
        raise ConfigError(f"unknown config key '{full}'{_closest(full, _all_keys())} (run with --help for all keys)")
    return section, key


def _field_type(section: str, key: str):
    hints = typing.get_type_hints(_sections()[section])
    return hints[key]


def _convert(section: str, key: str, value):
    """Coerce a TOML value or CLI string to the field's type; raise ConfigError naming key, value and type."""
    tp = _field_type(section, key)
    optional = False
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional, tp = True, args[0]
    name = f"{section}.{key}"
    if optional and (value is None or (isinstance(value, str) and value.lower() in ("none", "null", ""))):
        return None
    origin = typing.get_origin(tp)
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
                return value.lower() in ("true", "1", "yes")
            raise ValueError
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            return str(value)
        if origin is list:
            (item_tp,) = typing.get_args(tp)
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, list):
                raise ValueError
            return [item_tp(v) for v in value]
    except (TypeError, ValueError):
        pass
    type_name = getattr(tp, "__name__", str(tp)) + (" or none" if optional else "")
    raise ConfigError(f"{name}={value!r} is not a valid {type_name}")


def _assign(config: JobConfig, section: str, key: str, raw) -> None:
    section, key = _resolve_key(section, key)
    value = _convert(section, key, raw)
    choices = _fields(_sections()[section])[key].metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{section}.{key}={value!r} is not allowed; choose one of: {', '.join(map(str, choices))}")
    setattr(getattr(config, section), key, value)


def load_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"job.config_file='{path}' does not exist; pass an existing TOML file (see train_configs/)")
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"job.config_file='{path}' is not valid TOML: {e}")


def _split_cli(argv: list[str]) -> list[tuple[str, str, object]]:
    """Turn `--section.key value`, `--section.key=value` and bare boolean `--section.key` into triples."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument '{arg}'; overrides look like --section.key value (see --help)")
        name, eq, value = arg[2:].partition("=")
        section, _, key = name.partition(".")
        section, key = _resolve_key(section, key.replace("-", "_"))
        if not eq:
            is_bool = _field_type(section, key) is bool
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if is_bool and (nxt is None or nxt.startswith("--")):
                value = True
            elif nxt is None:
                raise ConfigError(f"--{section}.{key} needs a value")
            else:
                value, i = nxt, i + 1
        pairs.append((section, key, value))
        i += 1
    return pairs


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Build the JobConfig from defaults, the TOML file named by --job.config_file, and CLI overrides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(help_text())
        raise SystemExit(0)
    overrides = _split_cli(argv)
    config = JobConfig()
    config_files = [v for s, k, v in overrides if (s, k) == ("job", "config_file")]
    if config_files:
        for section, values in load_toml(str(config_files[-1])).items():
            if not isinstance(values, dict):
                raise ConfigError(f"top-level key '{section}' in the TOML file must be a [section] table")
            for key, value in values.items():
                _assign(config, section, key, value)
    for section, key, value in overrides:
        _assign(config, section, key, value)
    validate(config)
    return config


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(config: JobConfig) -> None:
    """Checks that need no torch and no world size; layout checks live in ParallelDims."""
    t, m, p = config.training, config.metrics, config.parallelism
    for name, value in [
        ("training.local_batch_size", t.local_batch_size),
        ("training.seq_len", t.seq_len),
        ("training.steps", t.steps),
        ("metrics.log_freq", m.log_freq),
        ("validation.freq", config.validation.freq),
        ("validation.steps", config.validation.steps),
        ("training.gc_freq", t.gc_freq),
        ("checkpoint.interval", config.checkpoint.interval),
        ("parallelism.data_parallel_replicate_degree", p.data_parallel_replicate_degree),
        ("parallelism.tensor_parallel_degree", p.tensor_parallel_degree),
        ("parallelism.pipeline_parallel_degree", p.pipeline_parallel_degree),
        ("parallelism.context_parallel_degree", p.context_parallel_degree),
    ]:
        _require(value >= 1, f"{name}={value} must be >= 1")
    _require(
        p.data_parallel_shard_degree == -1 or p.data_parallel_shard_degree >= 1,
        f"parallelism.data_parallel_shard_degree={p.data_parallel_shard_degree} must be -1 (the ranks left over) or >= 1",
    )
    _require(
        t.global_batch_size == -1 or t.global_batch_size >= t.local_batch_size,
        f"training.global_batch_size={t.global_batch_size} must be -1 or >= training.local_batch_size={t.local_batch_size}",
    )
    _require(config.optimizer.lr > 0, f"optimizer.lr={config.optimizer.lr} must be > 0")
    _require(config.lr_scheduler.warmup_steps >= 0, f"lr_scheduler.warmup_steps={config.lr_scheduler.warmup_steps} must be >= 0")
    ratio = config.lr_scheduler.decay_ratio
    _require(ratio is None or 0.0 <= ratio <= 1.0, f"lr_scheduler.decay_ratio={ratio} must be between 0 and 1 (or none)")
    factor = config.lr_scheduler.min_lr_factor
    _require(0.0 <= factor <= 1.0, f"lr_scheduler.min_lr_factor={factor} must be between 0 and 1")
    mb = p.pipeline_parallel_microbatch_size
    _require(
        mb >= 1 and t.local_batch_size % mb == 0,
        f"parallelism.pipeline_parallel_microbatch_size={mb} must be >= 1 and divide training.local_batch_size={t.local_batch_size}",
    )
    _require(m.peak_flops >= 0, f"metrics.peak_flops={m.peak_flops} must be >= 0 (0 = automatic)")
    _require(config.model.n_layers >= 0, f"model.n_layers={config.model.n_layers} must be >= 0 (0 = the flavor's)")
    _require(m.gpu_hour_cost >= 0, f"metrics.gpu_hour_cost={m.gpu_hour_cost} must be >= 0 (dollars; 0 = off)")
    for part in config.compile.components:
        _require(part in ("model", "loss"), f"compile.components has '{part}'; allowed: model, loss")
    # Sections later work fills in: refuse them loudly rather than train without them.
    f8 = config.float8
    _require(
        not (f8.enable and f8.enable_fsdp_float8_all_gather and f8.recipe_name != "tensorwise"),
        f"float8.enable_fsdp_float8_all_gather needs float8.recipe_name='tensorwise', not '{f8.recipe_name}'; "
        "turn one of them off",
    )
    _require(
        not (f8.enable and f8.enable_fsdp_float8_all_gather and config.parallelism.tensor_parallel_degree > 1
             and not f8.precompute_float8_dynamic_scale_for_fsdp),
        "float8.enable_fsdp_float8_all_gather with tensor_parallel_degree > 1 needs "
        "float8.precompute_float8_dynamic_scale_for_fsdp=true (the scale spans the TP shards too)",
    )
    for part in config.checkpoint.exclude_from_loading:
        _require(
            part in ("model", "optimizer", "train", "dataloader"),
            f"checkpoint.exclude_from_loading has '{part}'; allowed: model, optimizer, train, dataloader",
        )
    _require(t.max_skipped_steps >= 0, f"training.max_skipped_steps={t.max_skipped_steps} must be >= 0")
    _require(config.checkpoint.keep_latest_k >= 0, f"checkpoint.keep_latest_k={config.checkpoint.keep_latest_k} must be >= 0")
    _require(config.profiling.profile_freq >= 2, f"profiling.profile_freq={config.profiling.profile_freq} must be >= 2")
    for name in ("init_timeout_seconds", "train_timeout_seconds", "checkpoint_timeout_seconds"):
        value = getattr(config.comm, name)
        _require(value >= 1, f"comm.{name}={value} must be >= 1")
    sac = config.activation_checkpoint.selective_ac_option
    _require(
        sac == "op" or (sac.isdigit() and int(sac) >= 1),
        f"activation_checkpoint.selective_ac_option='{sac}' must be 'op' or a positive integer",
    )


def help_text() -> str:
    lines = [
        "usage: ./run_train.sh [--section.key value ...]   (or: python -m titanlite.train --job.config_file FILE ...)",
        "",
        "Every key can be set in the TOML file ([section] key = value) or on the command line",
        "(--section.key value, --section.key=value; booleans also as a bare --section.key; lists comma-separated).",
        "CLI wins over TOML, TOML wins over the defaults below.",
    ]
    for section, cls in _sections().items():
        lines.append(f"\n[{section}]")
        for key, f in _fields(cls).items():
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            choices = f.metadata.get("choices")
            extra = f" (one of: {', '.join(choices)})" if choices else ""
            lines.append(f"  --{section}.{key} = {_toml_value(default) if default is not None else 'none'}")
            lines.append(f"      {f.metadata['help']}{extra}")
    return "\n".join(lines)

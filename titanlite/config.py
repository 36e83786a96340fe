"""Job configuration: TorchTitan v0.2.2's JobConfig schema, one dataclass per TOML section.

Every section and key of TorchTitan v0.2.2 (`torchtitan/config/job_config.py`) exists here, nested
sections included (`[training.dataloader]`, `[quantize.linear.float8]`), so a TorchTitan config
loads unchanged. A key titanlite does not implement is accepted at its default value and refused at
any other (`not_implemented=`, with what to use instead); keys titanlite adds are marked
`extension=True`. `--help` lists both marks.

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

from titanlite.models import FAMILIES
from titanlite.models.args import MoEArgs

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the key, the value and the fix."""


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


def section(cls):
    return field(default_factory=cls)


NO_MOE = "titanlite's MoE family does not have it yet (its routed experts run in high precision, without DualPipeV overlap)"
NO_TORCHFT = "titanlite has no TorchFT integration; restarts resume from checkpoints (MAX_RESTARTS)"
NO_MX = "MX formats are not implemented; use model.converters = [\"float8\"]"
FLOAT8_CONVERTERS = ("quantize.linear.float8", "float8")


@dataclass
class Job:
    config_file: str | None = opt(None, "TOML file to load; CLI overrides win over it")
    dump_folder: str = opt("./outputs", "run folder: metrics.jsonl, TensorBoard, checkpoints, resolved config")
    description: str = opt("default job", "free text, at the start of the first log line")
    print_config: bool = opt(False, "print the resolved config (JSON) at start")
    save_config_file: str | None = opt(None, "also write the resolved config as JSON to this file, inside dump_folder")
    custom_config_module: str = opt("", "a module extending the JobConfig", not_implemented="add keys to titanlite/config.py")


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "torch.profiler traces, per rank")
    save_traces_folder: str = opt("profile_traces", "trace folder, inside dump_folder")
    profile_freq: int = opt(10, "one profiling cycle every N steps (warm-up and active steps at its end)")
    profiler_active: int = opt(1, "steps recorded per cycle")
    profiler_warmup: int = opt(3, "warm-up steps before the recorded ones, per cycle")
    enable_memory_snapshot: bool = opt(False, "CUDA allocator memory snapshots every profile_freq steps (GPU only)")
    save_memory_snapshot_folder: str = opt("memory_snapshot", "snapshot folder, inside dump_folder")


@dataclass
class Metrics:
    log_freq: int = opt(10, "log every N steps (and step 1)")
    enable_tensorboard: bool = opt(False, "write TensorBoard event files")
    disable_color_printing: bool = opt(False, "plain console lines (colours are used only on a terminal anyway)")
    save_tb_folder: str = opt("tb", "TensorBoard folder, inside dump_folder")
    save_for_all_ranks: bool = opt(
        False,
        "every rank writes its own TensorBoard folder (<save_tb_folder>/rank_<r>) and W&B run; false: rank 0 does "
        "(its loss is the global one, summed over pipeline stages too)",
    )
    enable_wandb: bool = opt(False, "log the same scalars to Weights & Biases (pip install -e '.[wandb]'; WANDB_MODE=offline works)")
    peak_flops: float = opt(
        0.0, "peak FLOP/s per device for MFU; 0 = look up the GPU, or measure a matmul on CPU", extension=True
    )
    gpu_hour_cost: float = opt(
        0.0, "dollars per device-hour, for the cost per million tokens (0 = not reported)", extension=True
    )


@dataclass
class Model:
    name: str = opt("llama3", "model family", choices=tuple(FAMILIES))
    flavor: str = opt(
        "debugmodel", "size preset of the family: " + "; ".join(f"{n}: {', '.join(f.flavors)}" for n, f in FAMILIES.items())
    )
    hf_assets_path: str = opt(
        "shakespeare-bpe8k",
        "folder of Hugging Face assets: tokenizer.json (+ tokenizer_config.json) or tokenizer.model, and for "
        "checkpoint.initial_load_in_hf the *.safetensors + config.json; or a bundled tokenizer: 'shakespeare-bpe8k', "
        "'byte' (no files)",
    )
    tokenizer_path: str | None = opt(None, "DEPRECATED in TorchTitan v0.2 (use hf_assets_path); when set, the tokenizer file or folder")
    converters: list[str] = opt(
        [],
        "model converters, applied before parallelism: 'quantize.linear.float8' (TorchTitan's name) or 'float8' (the "
        "name its configs use), set in [quantize.linear.float8]",
        choices=FLOAT8_CONVERTERS + ("quantize.linear.mx", "quantize.grouped_mm.float8", "quantize.grouped_mm.mx"),
        unsupported={"quantize.linear.mx": NO_MX, "quantize.grouped_mm.float8": NO_MOE, "quantize.grouped_mm.mx": NO_MOE},
    )
    print_after_conversion: bool = opt(False, "print the model after the converters")
    n_layers: int = opt(
        0, "transformer blocks; 0 = the flavor's (fewer: a big model's shape on fewer GPUs)", extension=True
    )
    moe_grouped_mm: bool = opt(
        True, "MoE experts through torch._grouped_mm; false: an exact loop over experts (same results)", extension=True
    )
    moe_load_balance_coeff: float | None = opt(
        None, "MoE expert-bias update per step (auxiliary-loss-free balancing); 0 = off; none = the flavor's", extension=True
    )
    moe_aux_loss_coeff: float | None = opt(
        None, "MoE sequence-wise balance loss coefficient; 0 = off; none = the flavor's", extension=True
    )
    attn_mask_type: str | None = opt(
        None,
        "attention mask: 'causal' over the whole packed window, or 'block_causal' within each document (documents "
        "start at the tokenizer's BOS); none = the flavor's (TorchTitan's *_flex_attn/_flex/_varlen flavors: block_causal)",
        choices=(None, "causal", "block_causal"),
        extension=True,
    )
    attn_type: str | None = opt(
        None,
        "attention kernel for block_causal: 'flex' (FlexAttention, CUDA; elsewhere sdpa runs instead) or 'sdpa' (a "
        "boolean mask; exact anywhere); 'varlen' runs on flex; none = the flavor's (flex)",
        choices=(None, "sdpa", "flex", "varlen"),
        extension=True,
    )
    reset_position_ids: bool = opt(
        False, "RoPE positions restart at each document (needs attn_mask_type='block_causal'; Megatron's name)",
        extension=True,
    )
    fused_projections: bool = opt(
        True,
        "q/k/v in one matmul, and SwiGLU's w1/w3 in one (TorchTitan 0.3.0 fuses q/k/v by default); parameters, "
        "checkpoints and Hugging Face names stay separate (speed measured in docs/benchmarks.md; float8 linears "
        "keep their own matmuls)",
        extension=True,
    )


@dataclass
class Optimizer:
    name: str = opt("AdamW", "optimizer", choices=("AdamW", "Adam"))
    lr: float = opt(8e-4, "peak learning rate")
    beta1: float = opt(0.9, "Adam beta1")
    beta2: float = opt(0.95, "Adam beta2")
    eps: float = opt(1e-8, "Adam epsilon")
    weight_decay: float = opt(0.1, "decoupled weight decay")
    implementation: str = opt(
        "fused", "Adam kernel: fused, foreach or for-loop", choices=("for-loop", "foreach", "fused")
    )
    early_step_in_backward: bool = opt(
        False, "step the optimizer inside backward", not_implemented="it cannot clip gradients; leave it false"
    )


@dataclass
class LRScheduler:
    warmup_steps: int = opt(200, "linear warmup steps")
    total_steps: int | None = opt(None, "steps the schedule spans; none = training.steps")
    decay_ratio: float | None = opt(
        None, "fraction of steps spent decaying at the end (warmup-stable-decay); none = decay right after warmup"
    )
    decay_type: str = opt("linear", "decay curve", choices=("linear", "sqrt", "cosine"))
    min_lr_factor: float = opt(0.0, "final lr as a fraction of the peak lr")


@dataclass
class DataLoader:
    num_workers: int = opt(0, "loader worker processes (each reads its share of this rank's documents)")
    persistent_workers: bool = opt(False, "keep workers alive between passes (needs num_workers > 0)")
    pin_memory: bool = opt(False, "batches in pinned host memory (faster copies to the GPU)")
    prefetch_factor: int | None = opt(None, "batches each worker loads ahead (needs num_workers > 0; none = 2)")


@dataclass
class Training:
    dataset: str = opt(
        "shakespeare",
        "'shakespeare' (built in), 'c4' (allenai/c4 en, streamed), a Hugging Face hub dataset name, or a local "
        "file/folder/glob (.jsonl, .jsonl.gz, .parquet, .txt)",
    )
    dataset_path: str | None = opt(None, "local file, folder or glob to read `dataset` from")
    local_batch_size: int = opt(8, "sequences per data-parallel rank per microbatch")
    global_batch_size: int = opt(
        -1, "sequences per optimizer step over all ranks; -1 = local_batch_size x dp (no gradient accumulation)"
    )
    seq_len: int = opt(2048, "tokens per sequence")
    max_norm: float = opt(1.0, "gradient-norm clipping threshold; <= 0 disables clipping")
    steps: int = opt(10000, "optimizer steps to train")
    enable_cpu_offload: bool = opt(False, "FSDP keeps parameters, gradients and optimizer states in host memory (CPUOffloadPolicy)")
    dtype: str = opt(
        "float32",
        "dtype of parameters, gradients and optimizer states; bfloat16 = full bf16 training (RoPE and logits stay fp32)",
        choices=("bfloat16", "float32"),
    )
    mixed_precision_param: str = opt(
        "auto",
        "parameter dtype for compute (FSDP's mixed precision): auto (bfloat16 on GPU, float32 on CPU), bfloat16, float32",
        choices=("auto", "bfloat16", "float32"),
    )
    mixed_precision_reduce: str = opt("float32", "dtype of gradient reductions", choices=("float32",))
    gc_freq: int = opt(50, "run Python garbage collection every N steps (automatic GC is off while training)")
    gc_debug: bool = opt(False, "a full garbage collection every step (slow; memory held by reference cycles shows at once)")
    dataloader: DataLoader = section(DataLoader)
    dataset_text_field: str = opt("text", "the column holding the document text", extension=True)
    data_split: str = opt(
        "documents",
        "how data-parallel ranks split the data: 'documents' (each reads a disjoint part: fast at scale) or "
        "'sequences' (each reads the whole stream and takes its rows of every global batch: the same batches, "
        "and losses, on any layout)",
        choices=("documents", "sequences"),
        extension=True,
    )
    skip_nonfinite_steps: bool = opt(
        False, "skip an optimizer step whose grad norm is NaN or Inf (logged and counted) instead of stopping the run",
        extension=True,
    )
    max_skipped_steps: int = opt(
        10, "with skip_nonfinite_steps: stop the run once more steps than this were skipped", extension=True
    )


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = opt(1, "replicas (DDP, or HSDP's outer dim)")
    data_parallel_shard_degree: int = opt(-1, "FSDP shards; -1 = the ranks left over")
    fsdp_reshard_after_forward: str = opt(
        "default",
        "free gathered params after forward: default (yes unless PP), always, never",
        choices=("default", "always", "never"),
    )
    tensor_parallel_degree: int = opt(1, "tensor-parallel ranks (innermost mesh dim)")
    disable_loss_parallel: bool = opt(False, "gather the logits instead of a vocab-parallel cross entropy under TP")
    enable_async_tensor_parallel: bool = opt(
        False, "overlap TP's collectives with its matmuls (torch's micro-pipelined TP; needs compile.enable and CUDA)"
    )
    pipeline_parallel_degree: int = opt(1, "pipeline-parallel ranks (outermost mesh dim)")
    module_fqns_per_model_part: list[list[str]] | None = opt(
        None,
        "explicit stages: one list of module names per stage, e.g. [[\"tok_embeddings\", \"layers.0\"], "
        "[\"layers.1\", \"norm\", \"output\"]] (on the command line as JSON)",
    )
    pipeline_parallel_first_stage_less_layers: int = opt(1, "layers the first stage holds fewer than the others (it has the embedding)")
    pipeline_parallel_last_stage_less_layers: int = opt(1, "layers the last stage holds fewer than the others (it has norm + output)")
    pipeline_parallel_layers_per_stage: int | None = opt(
        None, "transformer layers per (virtual) stage; none = 1 stage per rank, 2 for multi-stage schedules"
    )
    pipeline_parallel_schedule: str = opt(
        "1F1B",
        "torch.distributed.pipelining schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
        "ZBVZeroBubble, DualPipeV (what the installed torch offers)",
    )
    pipeline_parallel_schedule_csv: str | None = opt(
        "", "a schedule from a CSV file", not_implemented="choose parallelism.pipeline_parallel_schedule by name"
    )
    pipeline_parallel_microbatch_size: int = opt(1, "sequences per pipeline microbatch (local_batch_size must divide by it)")
    pipeline_parallel_expert_parallel_overlap: bool = opt(True, "overlap EP and PP communication under DualPipeV", not_implemented=NO_MOE)
    context_parallel_degree: int = opt(1, "context-parallel ranks (the sequence split over ranks; ring attention)")
    context_parallel_load_balancer: str | None = opt(
        "headtail",
        "headtail: rank r holds sequence chunks r and 2cp-1-r, so causal attention work is even; none: contiguous chunks",
        choices=("headtail", "ptrr", None),
        unsupported={"ptrr": "it balances FlexAttention block masks by their work; use 'headtail' (exact with block_causal too)"},
    )
    context_parallel_rotate_method: str = opt(
        "allgather", "how KV shards move around the cp ring", choices=("allgather", "alltoall")
    )
    expert_parallel_degree: int = opt(
        1, "expert-parallel ranks (MoE models): the routed experts split over ranks borrowed from dp_shard x cp (x tp "
        "when expert_tensor_parallel_degree is 1)"
    )
    expert_tensor_parallel_degree: int = opt(
        1, "MoE under tensor parallel: 1 = routed experts whole (expert_parallel_degree borrows the tp ranks); "
        "tensor_parallel_degree = each expert's hidden dim split over tp"
    )
    expert_parallel_comm_backend: str = opt(
        "standard", "EP all-to-all backend: standard (torch.distributed all-to-all)", choices=("standard", "deepep"),
        unsupported={"deepep": "DeepEP kernels are not part of titanlite; use 'standard'"},
    )
    enable_sequence_parallel: bool = opt(True, "shard norms and activations along the sequence under TP", extension=True)


@dataclass
class Checkpoint:
    enable: bool = opt(False, "save distributed checkpoints and resume from the latest complete one")
    enable_ft_dataloader_checkpoints: bool = opt(
        True, "TorchFT's per-replica data loader checkpoints", not_implemented=NO_TORCHFT + " (the data position is always saved)"
    )
    folder: str = opt("checkpoint", "checkpoint folder, inside dump_folder (step-N subfolders)")
    interval: int = opt(500, "save every N steps (and at the last step)")
    initial_load_path: str | None = opt(None, "a checkpoint (step folder) to start from when the run has none of its own")
    initial_load_model_only: bool = opt(True, "from initial_load_path, load only the model weights")
    initial_load_in_hf: bool = opt(
        False, "start from Hugging Face safetensors (+ config.json): initial_load_path, else model.hf_assets_path"
    )
    initial_load_in_hf_quantized: bool = opt(
        False, "dequantize a quantized HF checkpoint", not_implemented="load an unquantized HF checkpoint"
    )
    last_save_model_only: bool = opt(True, "make the final checkpoint model-only (in export_dtype), for export")
    last_save_in_hf: bool = opt(False, "write the final checkpoint as Hugging Face safetensors + config.json (model only)")
    export_dtype: str = opt("float32", "dtype of model-only checkpoints", choices=("float16", "bfloat16", "float32"))
    async_mode: str = opt(
        "disabled",
        "disabled; async (write in the background while training goes on); async_with_pinned_mem (async, staging "
        "through pinned memory on CUDA)",
        choices=("disabled", "async", "async_with_pinned_mem"),
    )
    keep_latest_k: int = opt(10, "keep the newest k complete checkpoints; 0 = keep all")
    load_step: int = opt(-1, "resume from this step's checkpoint; -1 = the latest complete one")
    exclude_from_loading: list[str] = opt(
        [], "parts not to load", choices=("model", "optimizer", "lr_scheduler", "dataloader", "train_state")
    )
    enable_first_step_checkpoint: bool = opt(False, "also save after step 1 (checks a new cluster's storage early)")
    create_seed_checkpoint: bool = opt(
        False, "on 1 process: write the initial weights to <folder>/step-0 for every layout to load, then exit"
    )
    load_only: bool = opt(False, "load checkpoints but never save one")


@dataclass
class ActivationCheckpoint:
    mode: str = opt(
        "selective", "activation checkpointing", choices=("selective", "full", "memory_budget", "none"),
        unsupported={"memory_budget": "use mode 'selective' or 'full'"},
    )
    selective_ac_option: str = opt("2", "'op' (per-op policy) or an integer k (every k-th block)")
    per_op_sac_force_recompute_mm_shapes_by_fqns: list[str] = opt(
        ["moe.router.gate"], "matmul shapes the per-op policy always recomputes", not_implemented=NO_MOE
    )
    early_stop: bool = opt(False, "stop recomputing once every needed activation is back")
    memory_budget: float = opt(0.5, "compiler's memory budget for mode memory_budget", not_implemented="use mode 'selective' or 'full'")
    visualize_memory_budget_pareto: bool = opt(False, "plot the memory budget trade-off", not_implemented="use mode 'selective' or 'full'")
    preserve_rng_state: bool = opt(True, "restore the RNG state in recompute (exact with dropout; titanlite's models have none)")
    determinism_check: str = opt("default", "torch.utils.checkpoint's check of recomputed tensors: default or none", choices=("default", "none"))
    debug: bool = opt(False, "torch.utils.checkpoint's debug traces (slower)")


@dataclass
class Compile:
    enable: bool = opt(False, "torch.compile each transformer block (with TP: its attention and feed_forward)")
    components: list[str] = opt(["model", "loss"], "what to compile", choices=("model", "loss"))
    backend: str = opt("inductor", "torch.compile backend")


@dataclass
class Float8Linear:
    enable_fsdp_float8_all_gather: bool = opt(False, "FSDP all-gathers weights in float8 (tensorwise recipe)")
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(
        False, "with float8 all-gather: all weights' scales from one all-reduce per step"
    )
    recipe_name: str | None = opt(
        None, "scaling recipe; none = tensorwise", choices=("tensorwise", "rowwise", "rowwise_with_gw_hp", None)
    )
    filter_fqns: list[str] = opt([], "linear layers to keep in high precision (name substrings), e.g. output")
    emulate: bool = opt(False, "multiply dequantized float8 values in high precision (no float8 matmul hardware)")


@dataclass
class Float8GroupedMM:
    fqns: list[str] = opt([], "MoE layers whose grouped GEMMs run in float8", not_implemented=NO_MOE)


@dataclass
class MXLinear:
    mxfp8_dim1_cast_kernel_choice: str = opt("triton", "MX cast kernel", not_implemented=NO_MX)
    recipe_name: str = opt("mxfp8_cublas", "MX recipe", not_implemented=NO_MX)
    filter_fqns: list[str] = opt(["output"], "linear layers kept in high precision", not_implemented=NO_MX)


@dataclass
class MXGroupedMM:
    recipe_name: str = opt("mxfp8", "MX recipe of grouped GEMMs", not_implemented=NO_MOE)
    fqns: list[str] = opt([], "MoE layers whose grouped GEMMs run in MX", not_implemented=NO_MOE)


@dataclass
class QuantizedLinear:
    float8: Float8Linear = section(Float8Linear)
    mx: MXLinear = section(MXLinear)


@dataclass
class QuantizedGroupedMM:
    float8: Float8GroupedMM = section(Float8GroupedMM)
    mx: MXGroupedMM = section(MXGroupedMM)


@dataclass
class Quantize:
    linear: QuantizedLinear = section(QuantizedLinear)
    grouped_mm: QuantizedGroupedMM = section(QuantizedGroupedMM)


@dataclass
class Comm:
    init_timeout_seconds: int = opt(300, "timeout of collectives until the first step is done")
    train_timeout_seconds: int = opt(100, "timeout of collectives after the first step (catches hangs sooner)")
    trace_buf_size: int = opt(20000, "NCCL flight recorder entries (TORCH_NCCL_TRACE_BUFFER_SIZE); 0 = off")
    save_traces_folder: str = opt("comm_traces", "flight recorder dumps, inside dump_folder")
    save_traces_file_prefix: str = opt("rank_", "flight recorder dump file prefix")
    mode: str = opt(
        "default",
        "default; fake_backend: a dry run that builds the mesh and the parallelized model on the meta device for "
        "WORLD_SIZE ranks in one process (fake collectives), reports, and exits (run_train.sh: COMM_MODE=fake_backend)",
        choices=("default", "fake_backend", "local_tensor"),
        unsupported={"local_tensor": "use 'fake_backend' for a dry run, or real ranks (gloo on CPU) for numerics"},
    )
    checkpoint_timeout_seconds: int = opt(
        1800, "timeout of the async checkpoint's collectives (writing large shards in the background takes long)",
        extension=True,
    )


@dataclass
class MemoryEstimation:
    enable: bool = opt(False, "estimate FSDP memory", not_implemented="use scripts/plan.py or scripts/memory.py")
    disable_fake_mode: bool = opt(False, "estimate without FakeTensorMode", not_implemented="use scripts/plan.py")


@dataclass
class FaultTolerance:
    enable: bool = opt(False, "TorchFT integration", not_implemented=NO_TORCHFT)
    process_group: str = opt("gloo", "TorchFT process group", not_implemented=NO_TORCHFT)
    process_group_timeout_ms: int = opt(10000, "TorchFT process group timeout", not_implemented=NO_TORCHFT)
    replica_id: int = opt(0, "TorchFT replica id", not_implemented=NO_TORCHFT)
    group_size: int = opt(0, "TorchFT replica groups", not_implemented=NO_TORCHFT)
    min_replica_size: int = opt(1, "TorchFT minimum replicas", not_implemented=NO_TORCHFT)
    semi_sync_method: str | None = opt(None, "local_sgd or diloco", not_implemented=NO_TORCHFT)


@dataclass
class Experimental:
    custom_import: str = opt("", "a module to import at start", not_implemented="register models in titanlite/models")
    custom_args_module: str = opt("", "DEPRECATED in TorchTitan (job.custom_config_module)", not_implemented="add keys to titanlite/config.py")


@dataclass
class Validation:
    enable: bool = opt(False, "evaluate a held-out set during training")
    dataset: str = opt(
        "", "validation dataset (as training.dataset); empty = the held-out part of the training dataset "
        "(TorchTitan's default is its c4_validation)"
    )
    dataset_path: str | None = opt(None, "local path for the validation dataset")
    local_batch_size: int = opt(8, "sequences per data-parallel rank per validation batch")
    seq_len: int = opt(2048, "tokens per validation sequence")
    freq: int = opt(10, "evaluate every N steps (and at the last step)")
    steps: int = opt(-1, "batches per evaluation; -1 = the whole validation set")
    dataloader: DataLoader = section(DataLoader)


@dataclass
class Debug:
    seed: int | None = opt(None, "seed of the initial weights and of torch's RNG; none = drawn at random on rank 0 (logged)")
    deterministic: bool = opt(False, "use deterministic algorithms (slower)")
    deterministic_warn_only: bool = opt(False, "with deterministic: warn instead of failing on ops without a deterministic kernel")
    moe_force_load_balance: bool = opt(False, "round-robin tokens over experts", not_implemented=NO_MOE)


@dataclass
class JobConfig:
    job: Job = section(Job)
    profiling: Profiling = section(Profiling)
    metrics: Metrics = section(Metrics)
    model: Model = section(Model)
    optimizer: Optimizer = section(Optimizer)
    lr_scheduler: LRScheduler = section(LRScheduler)
    training: Training = section(Training)
    parallelism: Parallelism = section(Parallelism)
    checkpoint: Checkpoint = section(Checkpoint)
    activation_checkpoint: ActivationCheckpoint = section(ActivationCheckpoint)
    compile: Compile = section(Compile)
    quantize: Quantize = section(Quantize)
    comm: Comm = section(Comm)
    memory_estimation: MemoryEstimation = section(MemoryEstimation)
    fault_tolerance: FaultTolerance = section(FaultTolerance)
    experimental: Experimental = section(Experimental)
    validation: Validation = section(Validation)
    debug: Debug = section(Debug)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: Path) -> None:
        """Write the resolved config as TOML (loadable with --job.config_file; none values are left out)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = []
        for name, values in _tables(self.to_dict()):
            lines.append(f"[{name}]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None)
            lines.append("")
        path.write_text("\n".join(lines))

    @property
    def float8(self) -> Float8Linear | None:
        """The float8 settings when `model.converters` has float8, else None."""
        return self.quantize.linear.float8 if set(FLOAT8_CONVERTERS) & set(self.model.converters) else None

    @property
    def tokenizer(self) -> tuple[str, str]:
        """(location, the key that set it) of the tokenizer: the deprecated model.tokenizer_path wins
        over hf_assets_path."""
        if self.model.tokenizer_path:
            return self.model.tokenizer_path, "model.tokenizer_path"
        return self.model.hf_assets_path, "model.hf_assets_path"

    @property
    def dry_run(self) -> bool:
        return self.comm.mode == "fake_backend"


def float8_recipe(f8: Float8Linear) -> str:
    return f8.recipe_name or "tensorwise"


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


def _tables(values: dict, prefix: str = ""):
    """(dotted section name, its plain values) for every section, nested ones after their parent."""
    plain = {k: v for k, v in values.items() if not isinstance(v, dict)}
    if prefix:
        yield prefix, plain
    for k, v in values.items():
        if isinstance(v, dict):
            yield from _tables(v, f"{prefix}.{k}" if prefix else k)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # strings and (nested) lists of scalars are valid TOML in JSON syntax


def _is_section(f: dataclasses.Field) -> bool:
    return f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _leaves(cls=JobConfig, prefix: str = ""):
    """(dotted key, field, owning section class) of every value in the schema, in order."""
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if _is_section(f):
            yield from _leaves(f.default_factory, key + ".")
        else:
            yield key, f, cls


LEAVES = {key: (f, owner) for key, f, owner in _leaves()}
SECTIONS = {".".join(key.split(".")[:n]) for key in LEAVES for n in range(1, key.count(".") + 1)}


def _closest(name: str, candidates) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else ""


def _check_key(key: str) -> str:
    """The key itself if the schema has it; else ConfigError naming its new place or a close key."""
    if key in LEAVES:
        return key
    if key in MOVED:
        raise ConfigError(f"config key '{key}' is not in the TorchTitan v0.2 schema titanlite uses; use {MOVED[key]}")
    if key in SECTIONS:
        raise ConfigError(f"'{key}' is a section, not a key; set its keys ([{key}] key = value)")
    section = key.rsplit(".", 1)[0] if "." in key else key
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section [{section}]{_closest(section, SECTIONS)} (run with --help for all keys)")
    raise ConfigError(f"unknown config key '{key}'{_closest(key, LEAVES)} (run with --help for all keys)")


def _field_type(key: str):
    f, owner = LEAVES[key]
    return typing.get_type_hints(owner)[f.name]


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
    candidates, optional = _value_types(_field_type(key))
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


def get(config: JobConfig, key: str):
    owner = config
    for part in key.split("."):
        owner = getattr(owner, part)
    return owner


def _assign(config: JobConfig, key: str, raw) -> None:
    key = _check_key(key)
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


def _toml_pairs(table: dict, prefix: str = "") -> list[tuple[str, object]]:
    """Dotted keys and values of a parsed TOML file; nested tables are nested sections."""
    pairs = []
    for k, v in table.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key not in LEAVES:
            if not v and key not in SECTIONS:
                raise ConfigError(f"unknown config section [{key}]{_closest(key, SECTIONS)} (run with --help for all keys)")
            pairs += _toml_pairs(v, key + ".")  # its keys name a section, an old name (MOVED) or a near miss
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
        if key not in LEAVES and leaf.startswith("no_") and not eq and negated in LEAVES and _field_type(negated) is bool:
            pairs.append((negated, False))
            i += 1
            continue
        key = _check_key(key)
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if _field_type(key) is bool and (nxt is None or nxt.startswith("--")):
                value = True
            elif nxt is None:
                raise ConfigError(f"--{key} needs a value")
            else:
                value, i = nxt, i + 1
        pairs.append((key, value))
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
    config_files = [v for k, v in overrides if k == "job.config_file" and v]
    from_file = dict(_toml_pairs(load_toml(str(config_files[-1])))) if config_files else {}
    for key, value in [*from_file.items(), *overrides]:
        _assign(config, key, value)
    _tie_validation_to_training(config, from_file, {key for key, _ in overrides})
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
        tied_in_file = from_file.get(key, _default(LEAVES[key][0])) == from_file.get(training_key, _default(LEAVES[training_key][0]))
        if key not in from_cli and (key not in from_file or tied_in_file):
            setattr(config.validation, name, getattr(config.training, name))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_not_implemented(config: JobConfig) -> None:
    """A TorchTitan key titanlite does not implement is accepted only at its default."""
    for key, (f, _) in LEAVES.items():
        instead = f.metadata["not_implemented"]
        value, default = get(config, key), _default(f)
        if instead and value != default and not (value in (None, "") and default in (None, "")):
            raise ConfigError(
                f"{key}={get(config, key)!r} is not implemented in titanlite (a TorchTitan key, accepted only at its "
                f"default {_default(f)!r}); {instead}"
            )


def validate(config: JobConfig) -> None:
    """Checks that need no torch and no world size; layout checks live in ParallelDims."""
    check_not_implemented(config)
    flavors = FAMILIES[config.model.name].flavors
    owners = [name for name, family in FAMILIES.items() if config.model.flavor in family.flavors]
    _require(
        config.model.flavor in flavors,
        f"model.flavor='{config.model.flavor}' is not a flavor of model.name='{config.model.name}'"
        + (f" (it is a flavor of model.name='{owners[0]}')" if owners else "")
        + f"; choose one of: {', '.join(flavors)}",
    )
    for key in ("model.moe_load_balance_coeff", "model.moe_aux_loss_coeff"):
        value = get(config, key)
        _require(value is None or value >= 0, f"{key}={value} must be >= 0 (0 = off; none = the flavor's)")
    mask_type = config.model.attn_mask_type or flavors[config.model.flavor].attn_mask_type
    _require(
        not config.model.reset_position_ids or mask_type == "block_causal",
        f"model.reset_position_ids=true restarts RoPE positions at each document, but attention is {mask_type} over the "
        "whole window; set model.attn_mask_type='block_causal', or reset_position_ids=false",
    )
    if not isinstance(flavors[config.model.flavor], MoEArgs):
        for key in ("model.moe_grouped_mm", "model.moe_load_balance_coeff", "model.moe_aux_loss_coeff"):
            value, default = get(config, key), _default(LEAVES[key][0])
            _require(
                value == default,
                f"{key}={value!r} applies to MoE models, and model.name='{config.model.name}' has no experts; "
                "remove it, or choose model.name='moe'",
            )
    t, m, p, v, c = config.training, config.metrics, config.parallelism, config.validation, config.checkpoint
    for name, value in [
        ("training.local_batch_size", t.local_batch_size),
        ("training.seq_len", t.seq_len),
        ("training.steps", t.steps),
        ("metrics.log_freq", m.log_freq),
        ("validation.freq", v.freq),
        ("validation.local_batch_size", v.local_batch_size),
        ("validation.seq_len", v.seq_len),
        ("training.gc_freq", t.gc_freq),
        ("checkpoint.interval", c.interval),
        ("parallelism.data_parallel_replicate_degree", p.data_parallel_replicate_degree),
        ("parallelism.tensor_parallel_degree", p.tensor_parallel_degree),
        ("parallelism.pipeline_parallel_degree", p.pipeline_parallel_degree),
        ("parallelism.context_parallel_degree", p.context_parallel_degree),
        ("profiling.profiler_active", config.profiling.profiler_active),
    ]:
        _require(value >= 1, f"{name}={value} must be >= 1")
    _require(v.steps == -1 or v.steps >= 1, f"validation.steps={v.steps} must be >= 1, or -1 for the whole validation set")
    _require(
        p.data_parallel_shard_degree == -1 or p.data_parallel_shard_degree >= 1,
        f"parallelism.data_parallel_shard_degree={p.data_parallel_shard_degree} must be -1 (the ranks left over) or >= 1",
    )
    _require(
        t.global_batch_size == -1 or t.global_batch_size >= t.local_batch_size,
        f"training.global_batch_size={t.global_batch_size} must be -1 or >= training.local_batch_size={t.local_batch_size}",
    )
    _require(config.optimizer.lr > 0, f"optimizer.lr={config.optimizer.lr} must be > 0")
    s = config.lr_scheduler
    _require(s.warmup_steps >= 0, f"lr_scheduler.warmup_steps={s.warmup_steps} must be >= 0")
    _require(s.total_steps is None or s.total_steps >= 1, f"lr_scheduler.total_steps={s.total_steps} must be >= 1 (or none)")
    ratio = s.decay_ratio
    _require(ratio is None or 0.0 <= ratio <= 1.0, f"lr_scheduler.decay_ratio={ratio} must be between 0 and 1 (or none)")
    _require(0.0 <= s.min_lr_factor <= 1.0, f"lr_scheduler.min_lr_factor={s.min_lr_factor} must be between 0 and 1")
    mb = p.pipeline_parallel_microbatch_size
    _require(
        mb >= 1 and t.local_batch_size % mb == 0,
        f"parallelism.pipeline_parallel_microbatch_size={mb} must be >= 1 and divide training.local_batch_size={t.local_batch_size}",
    )
    for name in ("pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers"):
        _require(getattr(p, name) >= 0, f"parallelism.{name}={getattr(p, name)} must be >= 0")
    lps = p.pipeline_parallel_layers_per_stage
    _require(lps is None or lps >= 1, f"parallelism.pipeline_parallel_layers_per_stage={lps} must be >= 1 (or none)")
    _require(
        not (p.enable_async_tensor_parallel and p.tensor_parallel_degree > 1 and not config.compile.enable),
        "parallelism.enable_async_tensor_parallel=true needs compile.enable=true (torch pipelines TP's matmuls in "
        "compiled graphs); turn compile on or async TP off",
    )
    _require(m.peak_flops >= 0, f"metrics.peak_flops={m.peak_flops} must be >= 0 (0 = automatic)")
    _require(config.model.n_layers >= 0, f"model.n_layers={config.model.n_layers} must be >= 0 (0 = the flavor's)")
    _require(m.gpu_hour_cost >= 0, f"metrics.gpu_hour_cost={m.gpu_hour_cost} must be >= 0 (dollars; 0 = off)")
    converters = config.model.converters
    _require(
        len(set(converters)) == len(converters) and len(set(FLOAT8_CONVERTERS) & set(converters)) <= 1,
        f"model.converters={converters} names a converter twice ('float8' is 'quantize.linear.float8'); list each once",
    )
    f8 = config.float8
    if f8 is not None:
        _require(
            not (f8.enable_fsdp_float8_all_gather and float8_recipe(f8) != "tensorwise"),
            f"quantize.linear.float8.enable_fsdp_float8_all_gather needs recipe_name 'tensorwise', not "
            f"'{f8.recipe_name}'; turn one of them off",
        )
        _require(
            not (f8.enable_fsdp_float8_all_gather and p.tensor_parallel_degree > 1
                 and not f8.precompute_float8_dynamic_scale_for_fsdp),
            "quantize.linear.float8.enable_fsdp_float8_all_gather with tensor_parallel_degree > 1 needs "
            "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp=true (the scale spans the TP shards too)",
        )
    _require(
        not (c.initial_load_in_hf and not c.initial_load_model_only),
        "checkpoint.initial_load_in_hf=true loads weights only; set checkpoint.initial_load_model_only=true",
    )
    _require(
        not (c.last_save_in_hf and not c.last_save_model_only),
        "checkpoint.last_save_in_hf=true saves weights only; set checkpoint.last_save_model_only=true",
    )
    _require(t.max_skipped_steps >= 0, f"training.max_skipped_steps={t.max_skipped_steps} must be >= 0")
    _require(c.keep_latest_k >= 0, f"checkpoint.keep_latest_k={c.keep_latest_k} must be >= 0")
    pr = config.profiling
    _require(
        pr.profiler_warmup >= 0 and pr.profile_freq >= pr.profiler_warmup + pr.profiler_active,
        f"profiling.profile_freq={pr.profile_freq} must be >= profiler_warmup + profiler_active "
        f"({pr.profiler_warmup} + {pr.profiler_active})",
    )
    for name in ("init_timeout_seconds", "train_timeout_seconds", "checkpoint_timeout_seconds"):
        value = getattr(config.comm, name)
        _require(value >= 1, f"comm.{name}={value} must be >= 1")
    _require(config.comm.trace_buf_size >= 0, f"comm.trace_buf_size={config.comm.trace_buf_size} must be >= 0")
    _require(
        not (t.data_split == "sequences" and t.dataloader.num_workers > 1),
        f"training.dataloader.num_workers={t.dataloader.num_workers} with training.data_split='sequences': workers "
        "would each read a part of the one stream every rank reads in full; use num_workers <= 1 or data_split='documents'",
    )
    for key, loader in (("training.dataloader", t.dataloader), ("validation.dataloader", v.dataloader)):
        _require(loader.num_workers >= 0, f"{key}.num_workers={loader.num_workers} must be >= 0")
        _require(
            loader.num_workers > 0 or (loader.prefetch_factor is None and not loader.persistent_workers),
            f"{key}.prefetch_factor and persistent_workers need {key}.num_workers > 0",
        )
    sac = config.activation_checkpoint.selective_ac_option
    _require(
        sac == "op" or (sac.isdigit() and int(sac) >= 1),
        f"activation_checkpoint.selective_ac_option='{sac}' must be 'op' or a positive integer",
    )


def help_text() -> str:
    lines = [
        "usage: ./run_train.sh [--section.key value ...]   (or: python -m titanlite.train --job.config_file FILE ...)",
        "",
        "The schema is TorchTitan v0.2.2's JobConfig. Every key can be set in the TOML file ([section] key = value;",
        "nested sections as [quantize.linear.float8]) or on the command line (--section.key value, --section.key=value;",
        "booleans also as a bare --section.key or --section.no_key; lists comma-separated, nested lists as JSON).",
        "CLI wins over TOML, TOML wins over the defaults below.",
        "Marks: [not implemented] a TorchTitan key accepted only at its default; [titanlite] a key TorchTitan lacks.",
    ]
    current = None
    for key, f, _ in _leaves():
        section_name, name = key.rsplit(".", 1)
        if section_name != current:
            lines.append(f"\n[{section_name}]")
            current = section_name
        default = _default(f)
        meta = f.metadata
        marks = "[not implemented] " if meta["not_implemented"] else "[titanlite] " if meta["extension"] else ""
        choices = [c for c in meta["choices"] or () if c not in meta["unsupported"]]
        extra = f" (one of: {', '.join('none' if c is None else c for c in choices)})" if choices else ""
        instead = f"; {meta['not_implemented']}" if meta["not_implemented"] else ""
        lines.append(f"  --{key} = {_toml_value(default) if default is not None else 'none'}")
        lines.append(f"      {marks}{meta['help']}{extra}{instead}")
    return "\n".join(lines)

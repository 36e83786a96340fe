"""TorchTitan v0.2.2's JobConfig schema: one dataclass per TOML section.

Every section and key of TorchTitan v0.2.2 (`torchtitan/config/job_config.py`) exists here, nested
sections included (`[training.dataloader]`, `[quantize.linear.float8]`), so a TorchTitan config
loads unchanged. A key titanlite does not implement is accepted at its default value and refused at
any other (`not_implemented=`, with what to use instead); keys titanlite adds are marked
`extension=True` (config/fields.py). The model families' names and flavors come from the registry.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from titanlite.config.fields import NO_MOE, NO_MX, opt, section
from titanlite.config.quantize import FLOAT8_CONVERTERS, Float8Linear, Quantize
from titanlite.config.resilience import FaultInjection, FaultTolerance, Health
from titanlite.config.writing import toml_text
from titanlite.models import FAMILIES

@dataclass
class Job:
    config_file: str | None = opt(None, "TOML file to load; CLI overrides win over it")
    dump_folder: str = opt("./outputs", "run folder: metrics.jsonl, TensorBoard, checkpoints, resolved config")
    description: str = opt("default job", "free text, at the start of the first log line")
    print_config: bool = opt(False, "print the resolved config (JSON) at start")
    save_config_file: str | None = opt(None, "also write the resolved config as JSON to this file, inside dump_folder")
    custom_config_module: str = opt("", "a module extending the JobConfig", not_implemented="add keys to titanlite/config/schema.py")


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
        unsupported={"quantize.linear.mx": NO_MX, "quantize.grouped_mm.mx": NO_MX},
    )
    print_after_conversion: bool = opt(False, "print the model after the converters")
    n_layers: int = opt(
        0, "transformer blocks; 0 = the flavor's (fewer: a big model's shape on fewer GPUs)", extension=True
    )
    flavor_overrides: list[str] = opt(
        [], "the flavor's shapes changed, as name=value (e.g. n_group=4,topk_group=2,mtp_depth=0); names: the family's args",
        extension=True,
    )
    moe_grouped_mm: bool = opt(
        True, "MoE experts through torch._grouped_mm; false: an exact loop over experts (same results)", extension=True
    )
    moe_load_balance_coeff: float | None = opt(
        None, "MoE expert-bias update per step (auxiliary-loss-free balancing); 0 = off; none = the flavor's", extension=True
    )
    moe_aux_loss_coeff: float | None = opt(
        None, "MoE balance loss coefficient; 0 = off; none = the flavor's", extension=True
    )
    moe_aux_loss_type: str | None = opt(None, "MoE balance loss: sequence (DeepSeek-V3's, per sequence, summed over layers) or global_batch (Qwen's, over each forward's tokens on every data rank, averaged over layers); none = the flavor's",
                                        choices=(None, "sequence", "global_batch"), extension=True)
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
        "q/k/v in one matmul, and MLA's two down projections in one (TorchTitan 0.3.0 fuses q/k/v by default); parameters, "
        "checkpoints and Hugging Face names stay separate (speed measured in docs/benchmarks.md; float8 linears "
        "keep their own matmuls)",
        extension=True,
    )


@dataclass
class Optimizer:
    name: str = opt(
        "AdamW", "optimizer; Muon: Muon for the hidden matrices, AdamW (beta1, beta2, eps, adamw_lr, "
        "adamw_weight_decay) for adamw_params and every parameter of fewer than 2 dims", choices=("AdamW", "Adam", "Muon"),
    )
    lr: float = opt(8e-4, "peak learning rate")
    beta1: float = opt(0.9, "Adam beta1")
    beta2: float = opt(0.95, "Adam beta2")
    eps: float = opt(1e-8, "Adam epsilon")
    weight_decay: float = opt(0.1, "decoupled weight decay")
    implementation: str = opt(
        "fused", "Adam kernel: fused, foreach or for-loop", choices=("for-loop", "foreach", "fused")
    )
    momentum: float = opt(0.95, "Muon's momentum (a running average of the gradients)", extension=True)
    nesterov: bool = opt(True, "Muon's Nesterov momentum", extension=True)
    ns_steps: int = opt(5, "Muon's Newton-Schulz steps", extension=True)
    ns_dtype: str = opt(
        "auto", "dtype Muon's Newton-Schulz runs in: auto (bfloat16 on GPU, as torch.optim.Muon's; float32 on CPU), bfloat16, float32",
        choices=("auto", "bfloat16", "float32"), extension=True,
    )
    adjust_lr_fn: str = opt(
        "original", "Muon's lr per matrix shape: original sqrt(max(1, rows/cols)), or match_rms_adamw 0.2 sqrt(max(rows, cols))",
        choices=("original", "match_rms_adamw"), extension=True,
    )
    ns_distribution: str = opt(
        "owners", "where Muon's Newton-Schulz runs: owners (each sharded matrix gathered on one rank, round-robin, "
        "its pieces sent back) or every_rank (each rank gathers every matrix: Moonlight's Algorithm 1)",
        choices=("owners", "every_rank"), extension=True,
    )
    qk_clip_threshold: float = opt(
        0.0, "with Muon: MuonClip's QK-clip (Kimi K2): after each step, the query/key weights of every attention head whose "
        "largest logit passed this are scaled back to it; 0 = off (Kimi K2: 100)", extension=True,
    )
    adamw_params: list[str] = opt(
        ["tok_embeddings", "output", "router"],
        "with Muon: parameters AdamW takes, by module name (a glob on any dotted part of the name)", extension=True,
    )
    adamw_lr: float | None = opt(None, "with Muon: AdamW's lr; none = lr", extension=True)
    adamw_weight_decay: float | None = opt(None, "with Muon: AdamW's weight decay; none = weight_decay", extension=True)
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
        "file/folder/glob (.jsonl, .jsonl.gz, .parquet, .txt); or token files: a folder prepared by "
        "`python -m titanlite.data.prepare`, a Megatron prefix (PREFIX.bin + PREFIX.idx), OLMo .npy files",
    )
    dataset_path: str | None = opt(None, "local file, folder or glob to read `dataset` from")
    dataset_mixture: list[str] = opt(
        [], "token-file sources mixed by weight, in Megatron's blend notation: 'WEIGHT PATH' items, e.g. "
        "'0.7 /data/web,0.3 /data/code' (weights normalized; a path is a prepared folder, a Megatron prefix or "
        "OLMo .npy files); replaces dataset and dataset_path", extension=True,
    )
    dataset_shuffle: bool = opt(
        True, "token files are read in a seeded permutation of their windows (text streams in its stored order)",
        extension=True,
    )
    dataset_seed: int = opt(0, "seed of the token files' permutation (the same on every layout)", extension=True)
    local_batch_size: int = opt(8, "sequences per data-parallel rank per microbatch")
    loss_chunks: int = opt(1, "the output projection and cross entropy over this many pieces of the tokens, never the whole logits (1: whole)", extension=True)
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
        True, "fault tolerance: at a checkpoint the groups that do not write the model save their data position "
        "(false: a restarted group reads its data from the start)"
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
class Experimental:
    custom_import: str = opt("", "a module to import at start", not_implemented="register models in titanlite/models")
    custom_args_module: str = opt("", "DEPRECATED in TorchTitan (job.custom_config_module)", not_implemented="add keys to titanlite/config/schema.py")


@dataclass
class Validation:
    enable: bool = opt(False, "evaluate a held-out set during training")
    dataset: str = opt(
        "", "validation dataset (as training.dataset); empty = the held-out part of the training dataset "
        "(TorchTitan's default is its c4_validation)"
    )
    dataset_path: str | None = opt(None, "local path for the validation dataset")
    dataset_mixture: list[str] = opt(
        [], "held-out token-file sources, as training.dataset_mixture: each gets its own loss, and the "
        "validation loss is their weighted mean", extension=True,
    )
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
    health: Health = section(Health)
    fault_injection: FaultInjection = section(FaultInjection)
    experimental: Experimental = section(Experimental)
    validation: Validation = section(Validation)
    debug: Debug = section(Debug)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: Path) -> None:
        """Write the resolved config as TOML (loadable with --job.config_file; none values are left out)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(toml_text(self.to_dict()))

    @property
    def float8(self) -> Float8Linear | None:
        """The float8 settings when `model.converters` has float8, else None."""
        return self.quantize.linear.float8 if set(FLOAT8_CONVERTERS) & set(self.model.converters) else None

    @property
    def longest_sequence(self) -> int:
        """The RoPE table's length: training's sequences, or validation's where longer."""
        return max(self.training.seq_len, self.validation.seq_len if self.validation.enable else 0)

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

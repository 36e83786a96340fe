"""The command that trains a planned layout: run_train.sh with NGPU, NNODES and CONFIG_FILE, and
overrides for every choice the plan made (model, degrees, pipeline schedule, batch sizes, AC, float8,
compile), set both ways, so that whatever the config file says the run is the planned one."""

from __future__ import annotations

import shlex

from titanlite.models.common.args import ModelArgs
from titanlite.planner.cost_model import Layout

# The published Llama 3 presets; other families' files are their debug configs (--model.flavor
# overrides the shape, the rest of the file stands).
PRESETS = {"8B": "llama3_8b.toml", "70B": "llama3_70b.toml", "405B": "llama3_405b.toml"}
DEBUG_CONFIGS = {"llama3": "debug_model.toml", "qwen3": "debug_qwen3.toml", "moe": "debug_moe.toml",
                 "deepseek_v3": "debug_deepseek_v3.toml", "llama4": "debug_llama4.toml",
                 "gpt_oss": "debug_gpt_oss.toml"}


def config_file(name: str, flavor: str) -> str:
    """train_configs/ file for a family and flavor: Llama 3's sized presets (8B_flex is an 8B), else the family's debug one."""
    preset = PRESETS.get(flavor.split("_")[0]) if name == "llama3" else None
    return f"train_configs/{preset or DEBUG_CONFIGS[name]}"


def stage_split(n_layers: int, stages: int) -> tuple[int, int, int] | None:
    """(pipeline_parallel_layers_per_stage, first_stage_less_layers, last_stage_less_layers) that cut
    the blocks into exactly `stages` stages (titanlite counts the embedding and the output as that
    many blocks, 1 each by default); None where none of these does (titanlite would make another
    number of stages)."""
    for first, last in ((1, 1), (1, 0), (0, 1), (0, 0), (2, 1), (1, 2), (2, 2)):
        counted = n_layers + first + last
        lps = -(-counted // stages)  # the smallest that fits: larger ones only give fewer stages
        if -(-counted // lps) == stages and counted // stages >= max(first, last, 1):
            return lps, first, last
    return None


def run_flags(layout: Layout, model: ModelArgs, global_batch: int) -> list[str]:
    """The run_train.sh overrides that train `layout` (for layouts titanlite runs: no ZeRO-1, no
    published-only dispatchers), with `global_batch` sequences a step: under PP one pipeline step of
    all of a data rank's sequences, otherwise microbatches accumulated. Switches are set either way,
    since the config file may have them on (llama3_405b.toml: float8, compile, async TP)."""
    p = "--parallelism."
    data_ranks = layout.dp_replicate * layout.dp_shard
    flags = [f"{p}data_parallel_replicate_degree", str(layout.dp_replicate), f"{p}data_parallel_shard_degree", str(layout.dp_shard),
             f"{p}tensor_parallel_degree", str(layout.tp), f"{p}context_parallel_degree", str(layout.cp),
             f"{p}expert_parallel_degree", str(layout.ep), f"{p}pipeline_parallel_degree", str(layout.pp),
             "--training.global_batch_size", str(global_batch)]
    if layout.pp > 1:
        schedule = "ZBVZeroBubble" if layout.zero_bubble else "Interleaved1F1B" if layout.vp > 1 else "1F1B"
        flags += [f"{p}pipeline_parallel_schedule", schedule, f"{p}pipeline_parallel_microbatch_size", str(layout.microbatch),
                  "--training.local_batch_size", str(global_batch // data_ranks)]
        if layout.vp > 2:  # more stages per rank than the interleaved default of 2
            lps, first, last = stage_split(model.n_layers, layout.pp * layout.vp)
            flags += [f"{p}pipeline_parallel_layers_per_stage", str(lps), f"{p}pipeline_parallel_first_stage_less_layers", str(first),
                      f"{p}pipeline_parallel_last_stage_less_layers", str(last)]
    else:
        flags += ["--training.local_batch_size", str(layout.microbatch)]
    # The planner's "op" is titanlite's per-op policy; "selective" alone checkpoints every second block.
    ac = {"none": ["none"], "op": ["selective", "--activation_checkpoint.selective_ac_option", "op"], "full": ["full"]}[layout.ac]
    flags += ["--activation_checkpoint.mode", *ac]
    flags += ["--model.converters", "float8" if layout.float8 else ""]
    flags += ["--optimizer.name", "Muon"] if layout.muon else []
    flags += ["--compile.enable", str(layout.compile).lower()]
    flags += [f"{p}enable_async_tensor_parallel", str(layout.tp_overlap).lower()]
    return flags


def run_command(layout: Layout, model: ModelArgs, name: str, flavor: str, seq_len: int, global_batch: int,
                gpus_per_node: int = 8, flavor_overrides: tuple[str, ...] = (), n_layers: int = 0) -> str:
    """The shell line that trains `layout` (on each node: run_train.sh takes NODE_RANK and
    RDZV_ENDPOINT from the environment when NNODES > 1), and under it, where the config file is the
    family's debug one, a note of the keys a real run sets."""
    gpus = layout.gpus
    ngpu, nnodes = (gpus, 1) if gpus <= gpus_per_node else (gpus_per_node, gpus // gpus_per_node)
    if ngpu * nnodes != gpus:
        raise ValueError(f"{gpus} GPUs are not whole nodes of {gpus_per_node}")
    args = ["--model.name", name, "--model.flavor", flavor]
    args += ["--model.flavor_overrides", ",".join(flavor_overrides)] if flavor_overrides else []
    args += ["--model.n_layers", str(n_layers)] if n_layers else []
    args += ["--training.seq_len", str(seq_len), *run_flags(layout, model, global_batch)]
    file = config_file(name, flavor)
    line = f"NGPU={ngpu} NNODES={nnodes} CONFIG_FILE={file} ./run_train.sh {shlex.join(args)}"
    if file.endswith(DEBUG_CONFIGS[name]):  # a shell comment: pasted with the line, it runs nothing
        line += (f"\n# {file} is a debug run (its data, tokenizer and step count); for a real one also set "
                 "--training.dataset (or --training.dataset_path), --model.hf_assets_path (the model's tokenizer), "
                 "--training.steps and --lr_scheduler.warmup_steps")
    return line

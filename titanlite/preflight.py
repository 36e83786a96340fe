"""Check a config before any process starts: `python -m titanlite.preflight --job.config_file F ...`
(run_train.sh runs it with WORLD_SIZE set). Bad input ends here, as one line and exit code 2:
the schema (titanlite/config/), the layout for WORLD_SIZE ranks, the model's shapes against it, the batch
sizes, the pipeline split, and the run's files: the tokenizer (read), the dataset files (their
format sniffed), the dump folder (written), the folders the run writes into (checkpoints,
TensorBoard, traces, snapshots: none of them a file) and the checkpoint to load (its metadata and
shard files).
Every rank runs the same checks before it joins the process group (train.main), so a bad input
stops all ranks alike, none of them inside a collective. Torch is imported only when there is a
pipeline to check (its schedule classes) or a checkpoint to load (DCP's metadata classes)."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import time
from pathlib import Path

from titanlite.checkpoint.paths import checkpoint_folder, checkpoint_to_load
from titanlite.config import JobConfig, parse_args
from titanlite.config.keys import LEAVES, default_value, get
from titanlite.errors import ConfigError
from titanlite.data.sources import open_token_parts, token_parts
from titanlite.data.tokenizer import build_tokenizer
from titanlite.dump_folder import check_writable_folder
from titanlite.models import FAMILIES, model_args
from titanlite.parallel.dims import ParallelDims


def check(config: JobConfig, world_size: int) -> None:
    t = config.training
    dims = ParallelDims.from_config(config, world_size)
    family = FAMILIES[config.model.name]
    args = model_args(config.model.name, config.model.flavor, 0, t.seq_len, config.model.n_layers, config.model)
    family.check(args, dims)
    if config.checkpoint.enable and config.checkpoint.last_save_in_hf:
        family.check_hf_export(args)
    dims.accumulation_steps(t.local_batch_size, t.global_batch_size)
    injection = config.fault_injection
    if injection.kind and not 0 <= injection.rank < world_size:
        raise ConfigError(f"fault_injection.rank={injection.rank} is outside the world of {world_size} ranks (0..{world_size - 1})")
    if dims.pp_enabled:
        from titanlite.parallel.pipeline import plan_stages

        plan_stages(config, family.plan, args.n_layers, dims.pp, pp_rank=0)
    tokenizer = build_tokenizer(*config.tokenizer)
    if config.metrics.enable_wandb:
        check_wandb_installed()
    if config.fault_tolerance.enable:
        check_lighthouse(config.fault_tolerance.process_group_timeout_ms)
    if config.dry_run:
        return  # writes nothing, reads no data and loads no checkpoint
    check_writable_folder(config.job.dump_folder)
    for key, folder in output_folders(config):
        check_folder_path(config, key, folder)
    c = config.checkpoint
    if c.enable and c.load_only and not c.create_seed_checkpoint:  # read, never written: a file there is still wrong
        check_folder_path(config, "checkpoint.folder", checkpoint_folder(config), writes=False)
    if config.checkpoint.create_seed_checkpoint:
        return  # reads no data and loads no checkpoint
    for split, settings in (("train", t), ("validation", config.validation)):
        if split == "train" or config.validation.enable:
            check_data(config, split, settings, tokenizer, dims.dp_replicate * dims.dp_shard)
    found = checkpoint_to_load(config)
    if found is not None:
        from titanlite.checkpoint.reader import check_checkpoint_files  # imports torch (DCP's metadata classes)

        check_checkpoint_files(found[0], checkpoint_folder(config), own=found[1])


def check_data(config: JobConfig, split: str, settings, tokenizer, dp: int) -> None:
    """The split's source exists; token files are whole and were made with this run's tokenizer, and
    each validation source fills one global batch (it is read once)."""
    parts = token_parts(config, split)
    if parts is None:
        return
    section = "training" if split == "train" else "validation"
    key = f"{section}.dataset_mixture" if settings.dataset_mixture else f"{section}.dataset_path"
    streams = open_token_parts(parts, tokenizer, settings.seq_len, key)
    rows = settings.local_batch_size * dp
    for (part, _), stream in zip(parts, streams):
        if split == "validation" and stream.tokens // (settings.seq_len + 1) < rows:
            raise ConfigError(
                f"{key}: source '{part.path}' holds {stream.tokens // (settings.seq_len + 1)} windows of seq_len + 1 = "
                f"{settings.seq_len + 1} tokens, less than one global batch of {rows} (validation.local_batch_size x "
                "data-parallel ranks); give more held-out data or a smaller validation batch"
            )


def output_folders(config: JobConfig) -> list[tuple[str, Path]]:
    """(key, folder) of each folder the run will write into besides the dump folder, resolved as the
    trainer resolves it (inside job.dump_folder; an absolute name stands alone)."""
    m, p, c = config.metrics, config.profiling, config.checkpoint
    wanted = [
        ("checkpoint.folder", (c.enable and not c.load_only) or c.create_seed_checkpoint),  # load_only: never saves
        ("metrics.save_tb_folder", m.enable_tensorboard),
        ("profiling.save_traces_folder", p.enable_profiling),
        ("profiling.save_memory_snapshot_folder", p.enable_memory_snapshot),
        ("comm.save_traces_folder", config.comm.trace_buf_size > 0),  # NCCL's flight recorder, dumped on a timeout
    ]
    return [(key, Path(config.job.dump_folder) / get(config, key)) for key, on in wanted if on]


def check_folder_path(config: JobConfig, key: str, folder: Path, writes: bool = True) -> None:
    """No part of `folder` is a file and (`writes`) its nearest existing folder is writable. Nothing is
    created: some of these folders appear only on GPUs, or at a timeout."""
    for part in [folder, *folder.parents]:
        if not part.exists():
            continue
        why = "is a file, not a folder" if not part.is_dir() else "is not writable" if writes and not os.access(part, os.W_OK | os.X_OK) else ""
        if why:
            raise ConfigError(
                f"{key}='{get(config, key)}': the run {'writes into' if writes else 'loads from'} '{folder}', and '{part}' "
                f"{why}; set {key} to a folder {'you can write' if writes else 'of checkpoints'} (default '{default_value(LEAVES[key][0])}', inside job.dump_folder)"
            )
        return


def check_wandb_installed() -> None:
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("metrics.enable_wandb=true needs the wandb package: pip install -e '.[wandb]' (or set it false)")


def check_lighthouse(timeout_ms: int) -> None:
    """fault_tolerance.enable: torchft is installed and its Lighthouse answers within the timeout."""
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError("fault_tolerance.enable=true needs torchft: pip install -e '.[ft]' (or set it false)")
    address = os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if not address:
        raise ConfigError(
            "fault_tolerance.enable=true needs the Lighthouse's address in TORCHFT_LIGHTHOUSE (e.g. http://host:29510); "
            "or let run_train.sh start one: FT_LIGHTHOUSE=start"
        )
    host, _, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    deadline = time.monotonic() + timeout_ms / 1000
    while True:  # a Lighthouse started just before (FT_LIGHTHOUSE=start) takes a moment to listen
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=max(deadline - time.monotonic(), 0.01)).close()
            return
        except (OSError, ValueError) as e:
            if isinstance(e, ValueError) or time.monotonic() >= deadline:
                raise ConfigError(
                    f"TORCHFT_LIGHTHOUSE={address}: no Lighthouse answered within fault_tolerance.process_group_timeout_ms="
                    f"{timeout_ms} ({e}); start one (torchft_lighthouse --min_replicas N, or FT_LIGHTHOUSE=start) or fix the address"
                ) from None
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> None:
    try:
        check(parse_args(argv), int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        print(f"titanlite: config error: {e}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()

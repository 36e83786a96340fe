"""Which checkpoint folders are complete, and which one a run loads: plain pathlib (no torch), so
run_train.sh can check a config's checkpoint before any process starts."""

from __future__ import annotations

import re
from pathlib import Path

from titanlite.config import JobConfig
from titanlite.errors import ConfigError

STEP_DIR = re.compile(r"^step-(\d+)$")
# A save (tmp), a removal (deleting) or a replacement (replaced) that a crash may have cut short.
UNFINISHED_DIR = re.compile(r"^(step-\d+)\.(tmp|deleting|replaced)$")


def checkpoint_folder(config: JobConfig) -> Path:
    return Path(config.job.dump_folder) / config.checkpoint.folder


def is_hf_checkpoint(path: Path) -> bool:
    """A Hugging Face model folder: config.json and *.safetensors."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def complete_steps(folder: Path) -> list[int]:
    """Steps with a complete checkpoint (renamed from .tmp and holding DCP's metadata, or a final save
    in Hugging Face format), oldest first; also one moved aside for a new save of its step that a
    crash cut short (put back at start)."""
    if not folder.is_dir():
        return []
    steps = set()
    for path in folder.iterdir():
        name = path.name.removesuffix(".replaced")
        if (m := STEP_DIR.match(name)) and ((path / ".metadata").exists() or is_hf_checkpoint(path)):
            steps.add(int(m.group(1)))
    return sorted(steps)


def checkpoint_to_load(config: JobConfig) -> tuple[Path, bool] | None:
    """(the checkpoint folder a run starts from, whether it is the run's own), or None for a fresh
    start: `load_step`, else the latest complete one of the run, else `initial_load_path`."""
    c, folder = config.checkpoint, checkpoint_folder(config)
    steps = complete_steps(folder) if c.enable else []
    if c.load_step >= 0:
        if c.load_step not in steps:
            raise ConfigError(
                f"checkpoint.load_step={c.load_step} has no complete checkpoint in {folder} (found {steps or 'none'}"
                f"{'' if c.enable else '; checkpoint.enable is false'}); choose a saved step or -1 for the latest"
            )
        return folder / f"step-{c.load_step}", True
    if steps:
        return folder / f"step-{steps[-1]}", True
    if c.initial_load_in_hf:
        key, path = ("checkpoint.initial_load_path", c.initial_load_path) if c.initial_load_path else (
            "model.hf_assets_path", config.model.hf_assets_path)
        if not is_hf_checkpoint(Path(path)):
            raise ConfigError(
                f"checkpoint.initial_load_in_hf=true but {key}='{path}' holds no Hugging Face weights (config.json "
                "and *.safetensors); point it at a Hugging Face model folder"
            )
        return Path(path), False
    if c.initial_load_path:
        path = Path(c.initial_load_path)
        if is_hf_checkpoint(path):
            raise ConfigError(
                f"checkpoint.initial_load_path='{path}' is a Hugging Face folder; set checkpoint.initial_load_in_hf=true"
            )
        if not (path / ".metadata").is_file():
            raise ConfigError(
                f"checkpoint.initial_load_path='{path}' holds no complete DCP checkpoint (no .metadata); "
                "give a step folder such as outputs/run/checkpoint/step-1000"
            )
        return path, False
    return None

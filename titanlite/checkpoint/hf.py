"""Hugging Face folders: safetensors shards + config.json, as transformers writes and reads them.

The file side only: writing shards (and their index), reading tensors one at a time, checking the
files and config.json. Which names and layouts a family's weights take there is the family's own
Hugging Face mapping (models/<family>/hf.py, the `hf` of its ParallelPlan), which calls this.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from titanlite.errors import ConfigError

SHARD_BYTES = 5 * 2**30  # the shard size transformers writes by default (5 GB)


def write_shards(read, sizes: dict[str, int], folder: Path, dtype: torch.dtype, to_hf: Callable, config: dict,
                 shard_bytes: int = SHARD_BYTES) -> None:
    """Write weights as one model.safetensors, or shards of at most `shard_bytes` with
    model.safetensors.index.json, and config.json. `sizes` maps each titanlite name to its element
    count; `read(names)` returns those tensors, so only one shard's tensors are in memory at a time;
    `to_hf(name, tensor)` gives the (Hugging Face name, tensor) pairs of one of them."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    shards, size = [[]], 0
    for name, numel in sizes.items():
        nbytes = numel * dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map = {}
    for i, names in enumerate(shards, 1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = dict(pair for n, w in read(names).items() for pair in to_hf(n, w))
        save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    if len(shards) > 1:
        total = sum(sizes.values()) * dtype.itemsize
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def read_hf_config(folder: Path) -> tuple[dict, int, int]:
    """(config.json, attention heads, kv heads) of a Hugging Face model folder; ConfigError naming the
    file when it is not JSON or lacks the head count."""
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
        heads = config["num_attention_heads"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"Hugging Face config '{path}' cannot be read ({type(e).__name__}: {e}); use the config.json saved with "
            "the weights (it needs num_attention_heads)"
        ) from None
    return config, heads, config.get("num_key_value_heads", heads)


def check_hf_files(folder: Path) -> None:
    """Every safetensors file of a Hugging Face folder opens (safetensors checks its header against the
    file's length: a truncated or foreign file fails here), without reading any tensor."""
    from safetensors import safe_open

    read_hf_config(folder)
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except Exception as e:  # safetensors raises its own SafetensorError, or OSError
            raise ConfigError(
                f"Hugging Face weights '{path}' cannot be read ({e}); the file is damaged or not safetensors: "
                "copy it again from its source"
            ) from None


def hf_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every weight in a folder, one tensor in memory at a time."""
    from safetensors import safe_open

    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def check_config_values(config: dict, expected: dict, folder: Path) -> None:
    """ConfigError naming the first config.json value that differs from the model being trained.
    `expected`: key -> (the model's value, the value a config that leaves the key out means)."""
    for key, (value, absent) in expected.items():
        found = config.get(key)
        if found is None:  # keys a config may leave out (or set null)
            found = absent
        if found != value:
            raise ConfigError(
                f"Hugging Face checkpoint '{folder}' has {key}={found}, the model being trained {value}; choose the "
                "model.flavor (and tokenizer) the checkpoint was made for"
            )

"""Hugging Face folders: safetensors shards + config.json, as transformers writes and reads them.

The file side only: writing shards (and their index), reading tensors one at a time, checking the
files and config.json. Which names and layouts a family's weights take there is the family's own
Hugging Face mapping (models/<family>/hf.py, the `hf` of its ParallelPlan), which calls this.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from functools import partial
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


def no_expert_bias(name: str, bias: torch.Tensor, architecture: str) -> list:
    """Nothing to write for an expert bias the architecture lacks, so long as it is zero."""
    if bias.any():
        raise ConfigError(
            f"{name} is not zero, and {architecture} has no expert bias: the exported model would route "
            "differently; export a model trained with model.moe_load_balance_coeff=0"
        )
    return []


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


def hf_tensors(folder: Path, headers_only: bool = False, origin: list | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every tensor in a folder, one in memory at a time. `headers_only`:
    meta tensors of the files' shapes and dtypes, reading no data (a family's iter_hf then runs through
    the folder in moments); `origin` gets the (name, file) of each tensor as it is read, to blame a
    weight that does not fit on."""
    from safetensors import safe_open

    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if origin is not None:
                    origin.append((key, path))
                if headers_only:
                    part = f.get_slice(key)
                    yield key, torch.empty(part.get_shape(), dtype=SAFETENSORS_DTYPES.get(part.get_dtype(), torch.int64), device="meta")
                else:
                    yield key, f.get_tensor(key)


# safetensors' dtype names of the floating types (any other reads as int64: not floating point).
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
FINITE_CHUNK = 1 << 24  # elements isfinite looks at a time: a 16 MB mask, not one the size of the tensor


def check_hf_tensors(iter_hf: Callable, folder: Path, build: Callable, args) -> set[str]:
    """Every tensor a family's mapping (`iter_hf(folder, read)`) loads into a parameter of `build(args)`
    (built on the meta device) is floating point and of that parameter's shape, checked from the files'
    headers before any weight is read; ConfigError naming the tensor and its file. The parameters' names."""
    with torch.device("meta"):
        expected = dict(build(args).named_parameters())
    origin = []
    try:
        for name, t in iter_hf(folder, partial(hf_tensors, headers_only=True, origin=origin)):
            key, path = origin[-1]
            if name in expected and (tuple(t.shape) != tuple(expected[name].shape) or not t.dtype.is_floating_point):
                found = f"shape {list(t.shape)}" if t.dtype.is_floating_point else f"a {t.dtype} (not floating point) tensor"
                raise ConfigError(
                    f"Hugging Face weights '{path}': tensor {key} gives {name} {found}, the model being trained "
                    f"{list(expected[name].shape)}; use the checkpoint of this model.flavor (and model.flavor_overrides)"
                )
    except RuntimeError as e:  # a tensor the mapping cannot even reshape (a head split, experts stacked)
        key, path = origin[-1]
        raise ConfigError(f"Hugging Face weights '{path}': tensor {key} does not fit the model being trained "
                          f"({str(e).splitlines()[0]}); use the checkpoint of this model.flavor") from None
    return set(expected)


def checked_hf_weights(iter_hf: Callable, folder: Path, build: Callable, args) -> Iterator[tuple[str, torch.Tensor]]:
    """(titanlite name, tensor) of a family's weights in a Hugging Face folder: check_hf_tensors first,
    then finite_hf_weights over the weights that load into the model (only those are checked)."""
    yield from finite_hf_weights(iter_hf, folder, check_hf_tensors(iter_hf, folder, build, args))


def finite_hf_weights(iter_hf: Callable, folder: Path, loaded: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(titanlite name, tensor) of a family's weights in a Hugging Face folder, stopping at one of
    `loaded` (default: all) holding NaN or infinity in one line naming the tensor(s) it came from and
    their file (it would train, and its first step would blame the learning rate). Every rank checks
    all of them (each reads them whole anyway), so all ranks stop together rather than one rank while
    the others wait in a collective."""
    origin, start = [], 0
    for name, t in iter_hf(folder, partial(hf_tensors, origin=origin)):
        sources, start = origin[start:] or origin[-1:], len(origin)  # read since the last weight (gate_up: two from one)
        values = t.reshape(-1)
        if (loaded is None or name in loaded) and not all(
                torch.isfinite(part if part.dtype.itemsize > 1 else part.float()).all()  # float8: no isfinite
                for part in values.split(FINITE_CHUNK)):
            (key, path), many = sources[-1], len(sources) > 1
            which = f"one of the {len(sources)} tensors read into {name} ({sources[0][0]} .. {key})" if many else f"tensor {key}"
            raise ConfigError(f"Hugging Face weights '{path}': {which} ({t.dtype}) holds NaN or infinity; the file is "
                              "damaged or not these model weights: copy it again from its source")
        yield name, t


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


FP8_BLOCK = 128  # DeepSeek-V3's released weights: one scale per 128 x 128 block


def dequantized(tensors: Iterator[tuple[str, torch.Tensor]], folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with float8_e4m3fn weights multiplied out by their `<name>_scale_inv`
    (one float32 scale per FP8_BLOCK x FP8_BLOCK block, DeepSeek-V3's release format) into float32.
    A weight waits here until its scale has been read (and a scale for its weight)."""
    weights, scales = {}, {}
    for name, t in tensors:
        if name.endswith(".weight_scale_inv"):
            scales[name.removesuffix("_scale_inv")] = t
        elif t.dtype == torch.float8_e4m3fn:
            weights[name] = t
        else:
            yield name, t
            continue
        base = name.removesuffix("_scale_inv")
        if base in weights and base in scales:
            yield base, _multiply_blocks(weights.pop(base), scales.pop(base), folder, base)
    if weights or scales:
        name = next(iter(weights or scales))
        found, missing = (f"float8 weight {name}", f"{name}_scale_inv") if weights else (f"{name}_scale_inv", f"float8 weight {name}")
        raise ConfigError(
            f"Hugging Face checkpoint '{folder}' has {found} without {missing}; use the complete checkpoint (DeepSeek's "
            "float8 weights come with one scale per 128x128 block)"
        )


def _multiply_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, folder: Path, name: str) -> torch.Tensor:
    rows, cols = weight.shape
    blocks = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    if tuple(scale_inv.shape) != blocks:
        raise ConfigError(
            f"Hugging Face checkpoint '{folder}': {name}_scale_inv has shape {tuple(scale_inv.shape)}, and a {rows}x{cols} "
            f"weight in {FP8_BLOCK}x{FP8_BLOCK} blocks needs {blocks}; use the checkpoint's own scales"
        )
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return weight.float() * scale

"""Distributed checkpoints (torch.distributed.checkpoint): exact resume, async save, resharding.

A checkpoint is the folder `<dump_folder>/<checkpoint.folder>/step-N` holding, keyed by parameter
name (so any layout can load it):
  model.*        the model's parameters (merged over pipeline stages)
  optimizer.*    AdamW state, flattened per parameter name
  lr_scheduler.* the lr schedule's position
  train_state.*  step, tokens seen, skipped steps, RNG states
  dataloader.dp<r>.state   each data-parallel rank's loader state, as JSON in a uint8 tensor
  diloco.*       under DiLoCo, each fragment's last synced weights and outer momentum
(the parts `checkpoint.exclude_from_loading` names, as in TorchTitan). With
`checkpoint.last_save_in_hf` the last one is a Hugging Face folder instead (safetensors +
config.json, model only), and `initial_load_in_hf` starts from one.
Only tensors are stored, and loading refuses anything else: DCP would unpickle non-tensor items.
DCP's `.metadata` file is itself a pickle; reader.py reads it without trusting it (an
allow-list unpickler; shard files inside the folder, whole, and no larger than declared), and a
damaged checkpoint stops the run with a line naming the newest earlier whole step.

Atomic: ranks write into `step-N.tmp`; rank 0 renames it to `step-N` once the whole save is done,
so a crash mid-save leaves the previous checkpoint as the latest complete one.
"""

from __future__ import annotations

import json
import shutil
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titanlite.checkpoint.reader import DamagedCheckpoint, damaged_checkpoint_line, load_checked, read_tensor_metadata
from titanlite.checkpoint.paths import UNFINISHED_DIR, checkpoint_folder, checkpoint_to_load, complete_steps, is_hf_checkpoint
from titanlite.config import JobConfig
from titanlite.data.windows import MixedWindows
from titanlite.errors import ConfigError
from titanlite.float8 import plain_tensor
from titanlite.checkpoint.hf import SHARD_BYTES, checked_hf_weights, read_hf_config
from titanlite.metrics import log_line
from titanlite.models.common.fqn import canonical_fqn
from titanlite.parallel.parallelize import DTYPES, assign_full_value

PARTS = ("model", "optimizer", "lr_scheduler", "train_state", "dataloader", "diloco")


def json_tensor(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).clone()


def tensor_json(t: torch.Tensor):
    return json.loads(bytes(t.tolist()).decode())


def read_model_weights(checkpoint: Path, names=None, found=None) -> dict:
    """The model weights of a DCP checkpoint (those in `names`, or all) as full tensors on this
    process, whatever layout saved them. `found`: its read_tensor_metadata, when read already."""
    reader, metadata = found or read_tensor_metadata(checkpoint, {"model"})
    state = {
        key.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in metadata.items()
        if key.startswith("model.") and (names is None or key.removeprefix("model.") in names)
    }
    load_checked({"model": state}, reader, checkpoint, no_dist=True)
    return state


def write_hf(
    checkpoint: Path, out: Path, args, dtype: torch.dtype, adapter, shard_bytes: int = SHARD_BYTES, found=None
) -> None:
    """A DCP checkpoint's model as a Hugging Face folder, one safetensors shard in memory at a time,
    through the family's Hugging Face mapping `adapter` (its plan's `hf`). `found`: its read_tensor_metadata, when read already."""
    found = found or read_tensor_metadata(checkpoint, {"model"})
    sizes = {k.removeprefix("model."): m.size.numel() for k, m in found[1].items() if k.startswith("model.")}
    adapter.save_hf(lambda names: read_model_weights(checkpoint, set(names), found), sizes, args, out, dtype, shard_bytes)


def discard(folder: Path) -> None:
    """Remove a checkpoint folder: renamed first (atomic), so a crash during the removal never leaves
    a half-deleted folder that still looks complete."""
    trash = folder.with_name(folder.name + ".deleting")
    folder.rename(trash)
    shutil.rmtree(trash)


def model_state(parts, export_dtype: torch.dtype | None = None) -> dict:
    sd = {}
    for part in parts:
        sd.update({k: plain_tensor(v) for k, v in get_model_state_dict(part).items()})
    if export_dtype is not None:
        sd = {k: v.to(export_dtype) for k, v in sd.items()}
    return sd


def optimizer_state(parts, optimizers) -> dict:
    """Flattened per parameter name: 'state.<fqn>.exp_avg' tensors and 'param_groups.<fqn>.lr' values."""
    sd = {}
    for part, opt in zip(parts, optimizers):
        sd.update(get_optimizer_state_dict(part, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)))
    return sd


def tensors_only(optimizer_sd: dict) -> dict:
    """The saved part of optimizer state: its tensors. Hyperparameters come from the config and the lr
    from the schedule, so nothing needs pickling (DCP pickles non-tensor values)."""
    return {k: v for k, v in optimizer_sd.items() if k.startswith("state.")}


class Checkpointer:
    def __init__(self, config: JobConfig, trainer):
        self.config, self.c, self.trainer = config, config.checkpoint, trainer
        self.folder = checkpoint_folder(config)
        self.is_coordinator = dist.get_rank() == 0
        self.pending = None  # (future, tmp folder, final folder) of an async save in flight
        # Async saves get their own gloo group: sharing the training group corrupts its collectives.
        # Its own timeout, too: the collective timeout set after the first step is for training, and
        # this group also waits for rank 0 to convert a final save to Hugging Face format.
        self.checkpoint_group = None
        if self.c.enable and (self.c.async_mode != "disabled" or self.c.last_save_in_hf):
            self.checkpoint_group = dist.new_group(
                backend="gloo", timeout=timedelta(seconds=config.comm.checkpoint_timeout_seconds)
            )
        if self.c.enable and self.is_coordinator:
            self.remove_unfinished()

    def remove_unfinished(self) -> None:
        """Clean up after a crash: saves and removals it cut short are never loaded, so they go; a
        checkpoint that was being replaced by a new save of its step comes back if the new one did not."""
        if self.folder.is_dir():
            for path in self.folder.iterdir():
                if not (m := UNFINISHED_DIR.match(path.name)):
                    continue
                original = self.folder / m.group(1)
                if m.group(2) == "replaced" and not original.exists():
                    path.rename(original)
                else:
                    shutil.rmtree(path, ignore_errors=True)

    # ---- what is saved ----

    def state(self, model_only: bool = False, dtype: torch.dtype | None = None, data_only: bool = False) -> dict:
        """What a checkpoint holds: everything; the model alone (`model_only`, in `dtype`); or this rank's
        data position alone (`data_only`: a fault-tolerant replica group that does not write the model)."""
        t = self.trainer
        if model_only:
            dtype = dtype or DTYPES[self.c.export_dtype]
            return {"model": model_state(t.model_parts, dtype if dtype != torch.float32 else None)}
        workers = t.config.training.dataloader.num_workers
        loader = {"dp_degree": t.dp_degree, "num_workers": workers, "state": t.dataloader.state_dict(), "step": t.step,
                  "token_files": isinstance(t.dataloader.dataset, MixedWindows), "sample": t.samples_read,
                  "spike_history": t.spikes.state() if t.spikes else None, "batches": t.batches.state()}  # the same on every rank
        if data_only:
            return {"dataloader": {f"dp{t.dp_rank}": json_tensor(loader)}}
        train = {
            "step": torch.tensor(t.step),
            "tokens_seen": torch.tensor(t.tokens_seen),
            "skipped_steps": torch.tensor(t.skipped_steps),
            "rng_cpu": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            train["rng_cuda"] = torch.cuda.get_rng_state()
        if t.ft:
            train["ft_step"] = torch.tensor(t.ft.manager.current_step())  # torchft's: a resumed group's standing
        state = {
            "model": model_state(t.model_parts),
            "optimizer": tensors_only(optimizer_state(t.model_parts, t.optimizers)),
            "lr_scheduler": {"step": torch.tensor(t.lr_schedulers[0].last_epoch)},
            "train_state": train,
            "dataloader": {f"dp{t.dp_rank}": json_tensor(loader)},
        }
        if t.ft and (diloco := t.ft.checkpoint_state()):
            state["diloco"] = diloco
        return state

    # ---- save ----

    def due(self, step: int, last: bool) -> bool:
        """Whether `maybe_save` saves at this step."""
        first = step == 1 and self.c.enable_first_step_checkpoint
        return self.c.enable and not self.c.load_only and (step % self.c.interval == 0 or last or first)

    def maybe_save(self, step: int, last: bool) -> None:
        self.finalize_if_done()
        if not self.due(step, last):
            return
        model_only = last and self.c.last_save_model_only
        # Fault tolerance: the model once, by one replica group; the others keep their data position
        # (each group writes its own final save, the result of its run).
        data_only = self.trainer.ft is not None and not last and not self.trainer.ft.writes_model()
        if data_only and not self.c.enable_ft_dataloader_checkpoints:
            return
        self.save(step, model_only=model_only, asynchronous=self.c.async_mode != "disabled" and not last,
                  in_hf=last and self.c.last_save_in_hf, data_only=data_only)

    def save(
        self, step: int, model_only: bool = False, asynchronous: bool = False, dtype: torch.dtype | None = None,
        in_hf: bool = False, data_only: bool = False,
    ) -> None:
        self.wait()  # one save in flight at a time
        final = self.folder / f"step-{step}"
        tmp = self.folder / f"step-{step}.tmp"
        if self.is_coordinator:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        dist.barrier()
        start = time.perf_counter()
        state = self.state(model_only, dtype, data_only)
        if asynchronous:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.checkpoint_group, **self.stager())
            self.pending = (future, tmp, final)
            log_line(f"checkpoint step {step}: async save started ({time.perf_counter() - start:.2f}s blocking)")
            return
        dcp.save(state, checkpoint_id=str(tmp))
        dist.barrier()
        if in_hf:
            self.convert_to_hf(tmp)
        self.commit(tmp, final)
        what = " (Hugging Face safetensors)" if in_hf else " (model only)" if model_only else " (data position only)" if data_only else ""
        log_line(f"checkpoint step {step}{what} saved to {final} in {time.perf_counter() - start:.2f}s")

    def convert_to_hf(self, folder: Path) -> None:
        """Rewrite a model-only DCP save as Hugging Face safetensors + config.json, in place (through
        the converter scripts/convert_hf.py uses): any layout wrote it, rank 0 converts it shard by
        shard while the others wait on the checkpoint group (its timeout is long)."""
        if self.is_coordinator:
            dcp_files = list(folder.iterdir())
            t = self.trainer
            write_hf(folder, folder, t.model_parts[0].args, DTYPES[self.c.export_dtype], adapter=t.plan.hf)
            for path in dcp_files:
                path.unlink()
        dist.barrier(group=self.checkpoint_group)

    def stager(self) -> dict:
        """async_with_pinned_mem: copy GPU tensors to a reused pinned host buffer (faster device->host)."""
        if self.c.async_mode != "async_with_pinned_mem" or not torch.cuda.is_available():
            return {}  # on CPU tensors already live in host memory: torch's default staging copy
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        options = StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False)
        return {"async_stager": DefaultStager(options)}

    def commit(self, tmp: Path, final: Path) -> None:
        """Make a fully written checkpoint visible (atomic rename), then drop the oldest ones."""
        if not self.is_coordinator:
            return
        if final.exists():  # the same step saved again (a run rewound with load_step): keep the old one
            replaced = final.with_name(final.name + ".replaced")  # until the new one is in place
            final.rename(replaced)
            tmp.rename(final)
            shutil.rmtree(replaced)
        else:
            tmp.rename(final)
        if self.c.keep_latest_k > 0:
            for step in complete_steps(self.folder)[: -self.c.keep_latest_k]:
                discard(self.folder / f"step-{step}")

    def finalize_if_done(self) -> None:
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        if self.pending is None:
            return
        future, tmp, final = self.pending
        future.result()  # the coordinator's future completes once every rank's data and the metadata are written
        self.pending = None
        self.commit(tmp, final)
        log_line(f"checkpoint {final.name}: async save complete")

    # ---- load ----

    def load(self) -> bool:
        """Resume from the latest complete checkpoint (or `load_step`), else from `initial_load_path`."""
        found = checkpoint_to_load(self.config)
        if found is None:
            return False
        path, own = found
        try:
            if own:
                path = self.resume_point(path)
            if is_hf_checkpoint(path):
                self.load_hf_weights(path)
                return True
            parts = {"model"} if not own and self.c.initial_load_model_only else set(PARTS)
            self.load_from(path, parts - set(self.c.exclude_from_loading))
        except DamagedCheckpoint as e:
            raise ConfigError(damaged_checkpoint_line(e, self.folder, own)) from None
        return True

    def resume_point(self, chosen: Path) -> Path:
        """The run's own checkpoint to resume: `chosen` if it holds the training state (or is the
        step-0 seed), else the newest one that does. A model-only final save (last_save_model_only,
        last_save_in_hf) cannot continue training, so resuming past it would restart at step 0."""
        if self.resumable(chosen) or self.trainer.ft and self.parts_of(chosen) == {"dataloader"}:
            return chosen  # a replica group's data position: its weights come from a peer
        if self.c.load_step >= 0:
            raise ConfigError(
                f"checkpoint.load_step={self.c.load_step}: {chosen} holds the model only (a last_save_model_only "
                "save) and cannot resume training; choose a full checkpoint, or start a new run from its weights "
                f"with checkpoint.initial_load_path={chosen} in another job.dump_folder"
            )
        for step in reversed(complete_steps(self.folder)):
            candidate = self.folder / f"step-{step}"
            if self.resumable(candidate):
                log_line(f"{chosen.name} holds the model only (last_save_model_only); resuming from {candidate.name}")
                return candidate
        raise ConfigError(
            f"the run's newest checkpoint {chosen} holds the model only (checkpoint.last_save_model_only=true) and "
            "there is no full one to resume training from; start a new run from its weights with "
            f"checkpoint.initial_load_path={chosen} in another job.dump_folder"
        )

    @staticmethod
    def parts_of(path: Path) -> set[str]:
        return set() if is_hf_checkpoint(path) else {key.split(".", 1)[0] for key in read_tensor_metadata(path, ())[1]}

    @classmethod
    def resumable(cls, path: Path) -> bool:
        if is_hf_checkpoint(path):
            return False
        keys = cls.parts_of(path)
        if "train" in keys:
            raise ConfigError(
                f"checkpoint '{path}' was written by a titanlite older than its TorchTitan v0.2.2 schema (a 'train' "
                "part, now 'train_state' and 'lr_scheduler'); resume it with that titanlite, or start from its "
                f"weights with checkpoint.initial_load_path={path} in another job.dump_folder"
            )
        return "train_state" in keys or path.name == "step-0"

    def load_hf_weights(self, folder: Path) -> None:
        """Model weights from Hugging Face safetensors: config.json, then every tensor's shape and dtype
        from the files' headers, are checked; every rank reads them one tensor at a time (their values
        checked) and keeps its shard of the parameters it holds."""
        t = self.trainer
        args = t.model_parts[0].args
        t.plan.hf.check_hf_shapes(read_hf_config(folder)[0], args, folder)
        params = {canonical_fqn(name): p for part in t.model_parts for name, p in part.named_parameters()}
        missing = set(params)
        for name, tensor in checked_hf_weights(t.plan.hf.iter_hf, folder, t.plan.build, args):
            if name in params:
                assign_full_value(params[name], tensor.to(params[name].dtype))
                missing.discard(name)
        optional = {name for name in missing if name.startswith(getattr(t.plan.hf, "OPTIONAL", ()))}
        if optional:
            log_line(f"Hugging Face checkpoint '{folder}' has no {sorted(optional)[0].split('.')[0]} weights: they keep their initialization")
        missing -= optional
        if missing:
            raise ConfigError(
                f"Hugging Face checkpoint '{folder}' lacks {len(missing)} weight(s) the model has, e.g. "
                f"{sorted(missing)[0]} (tied embeddings are not supported); use a checkpoint of the same architecture"
            )
        log_line(f"loaded Hugging Face weights from {folder} (model only)")

    def load_from(self, path: Path, parts: set[str]) -> None:
        t = self.trainer
        reader, metadata = read_tensor_metadata(path, parts)
        parts &= {key.split(".", 1)[0] for key in metadata}  # a model-only checkpoint resumes the weights only
        state = {}
        if "model" in parts:
            state["model"] = model_state(t.model_parts)
        if "optimizer" in parts:
            full_optimizer = optimizer_state(t.model_parts, t.optimizers)
            state["optimizer"] = tensors_only(full_optimizer)  # loaded in place into full_optimizer's tensors
        if "diloco" in parts and t.ft:
            state["diloco"] = t.ft.checkpoint_state()  # loaded in place, into DiLoCo's own tensors
        for name in ("lr_scheduler", "train_state", "dataloader"):
            if name in parts:
                state[name] = {
                    key.split(".", 1)[1]: torch.zeros(m.size, dtype=m.properties.dtype)
                    for key, m in metadata.items()
                    if key.startswith(f"{name}.")
                }
        for key, value in _flatten_items(state):
            if not isinstance(metadata.get(key), TensorStorageMetadata):
                raise ConfigError(optimizer_change(path, key, metadata, t.config.optimizer.name)
                                  or f"checkpoint '{path}' has no entry '{key}'; it was not written by this titanlite")
            if tuple(metadata[key].size) != tuple(value.shape):  # else DCP's size error reads like damage
                raise ConfigError(
                    f"checkpoint '{path}' entry '{key}' has shape {list(metadata[key].size)}, this run's {list(value.shape)}: "
                    "it was saved from another model shape; load it with the model config that saved it"
                )
        load_checked(state, reader, path)

        if "model" in state:
            for part in t.model_parts:
                set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        if "optimizer" in state:
            for part, opt in zip(t.model_parts, t.optimizers):
                set_optimizer_state_dict(
                    part, opt, full_optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
                )
        if "lr_scheduler" in state:
            for scheduler in t.lr_schedulers:
                scheduler.last_epoch = int(state["lr_scheduler"]["step"])
                for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_lr()):
                    group["lr"] = lr
        if "train_state" in state:
            s = state["train_state"]
            t.step, t.tokens_seen, t.skipped_steps = int(s["step"]), int(s["tokens_seen"]), int(s["skipped_steps"])
            torch.set_rng_state(s["rng_cpu"])
            if "rng_cuda" in s and torch.cuda.is_available():
                torch.cuda.set_rng_state(s["rng_cuda"])
            if t.ft:
                t.ft.resumed(int(s["ft_step"]) if "ft_step" in s else t.step)
        if "dataloader" in state:
            self.load_dataloader(state["dataloader"])
        else:
            t.batches.load(None, t.step)
        if t.ft and parts == {"dataloader"}:
            t.ft.data_step = next(tensor_json(v) for v in state["dataloader"].values())["step"]
            log_line(f"loaded this replica group's data position of step {t.ft.data_step} from {path}; its weights and "
                     "step come from a peer")
        else:
            log_line(f"loaded checkpoint {path} ({', '.join(sorted(parts))}) at step {t.step}")

    def load_dataloader(self, saved: dict) -> None:
        t = self.trainer
        states = {int(k[2:]): tensor_json(v) for k, v in saved.items()}
        saved_state = next(iter(states.values()))
        if t.spikes and saved_state.get("spike_history"):
            t.spikes.load(saved_state["spike_history"])
        t.batches.load(saved_state.get("batches"), t.step)
        old_degree, old_workers = saved_state["dp_degree"], saved_state["num_workers"]
        workers = t.config.training.dataloader.num_workers
        tokens = isinstance(t.dataloader.dataset, MixedWindows)
        if tokens and saved_state.get("token_files"):
            # Token files: the position is the next global sample, the same on any layout and worker count.
            t.dataloader.dataset.sample = t.samples_read = saved_state["sample"]
            t.dataloader.dataset.worker_sample = None  # a loader that read past it (a rollback's) starts there again,
            t.dataloader.load_state_dict({})  # and no worker of a past iterator goes on from its own position
            if (old_degree, old_workers) != (t.dp_degree, workers):
                log_line(f"data position (global sample {t.samples_read}) kept from {old_degree} to {t.dp_degree} "
                         f"data-parallel ranks, {old_workers} to {workers} loader workers")
        elif old_workers != workers:
            # Each worker reads its own files in its own order: the position of W workers means nothing to W'.
            log_line(
                f"data position NOT restored: saved with training.dataloader.num_workers={old_workers}, now {workers}; "
                "the data starts from the beginning (model, optimizer, step and lr schedule are restored)"
            )
        elif tokens != saved_state.get("token_files", False):
            log_line("data position NOT restored: it was saved from text and is read now from token files, or the other "
                     "way round; the data starts from the beginning (model, optimizer, step and lr schedule are restored)")
        elif old_degree == t.dp_degree:
            t.dataloader.load_state_dict(states[t.dp_rank]["state"])
        elif t.config.training.data_split == "sequences":
            # Every rank read the whole stream; the last rank's position is past every consumed window.
            t.dataloader.load_state_dict(states[old_degree - 1]["state"])
            log_line(f"data position re-split from {old_degree} to {t.dp_degree} data-parallel ranks")
        else:
            log_line(
                f"data position NOT restored: saved with {old_degree} data-parallel ranks, now {t.dp_degree}, and "
                "training.data_split='documents' gives each rank its own documents; the data starts from the "
                "beginning (model, optimizer, step and lr schedule are restored). Use data_split='sequences' to keep it"
            )


# The state each optimizer keeps per parameter: a checkpoint of one read by the other names the change.
OPTIMIZER_STATES = {"momentum_buffer": "Muon", "step": "AdamW or Adam", "exp_avg": "AdamW or Adam", "exp_avg_sq": "AdamW or Adam"}


def optimizer_change(path: Path, missing: str, metadata, name: str) -> str | None:
    """The line for a checkpoint whose optimizer state another optimizer saved, or None."""
    wanted = missing.rsplit(".", 1)[-1] if missing.startswith("optimizer.") else None
    saved = {OPTIMIZER_STATES[k.rsplit(".", 1)[-1]] for k in metadata if k.startswith("optimizer.")
             and k.rsplit(".", 1)[-1] in OPTIMIZER_STATES}
    if wanted not in OPTIMIZER_STATES or not saved or saved == {OPTIMIZER_STATES[wanted]}:
        return None
    return (f"checkpoint '{path}' holds the optimizer state of {' and '.join(sorted(saved))}, but optimizer.name='{name}' "
            f"keeps '{wanted}' for {missing.removeprefix('optimizer.state.').rsplit('.', 1)[0]}: the optimizer changed; "
            "set checkpoint.exclude_from_loading=['optimizer'] to start it anew from the saved weights, or the saved optimizer")


def _flatten_items(state: dict, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    items = []
    for k, v in state.items():
        if isinstance(v, dict):
            items += _flatten_items(v, f"{prefix}{k}.")
        else:
            items.append((f"{prefix}{k}", v))
    return items

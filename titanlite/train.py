"""Entry point: `torchrun ... -m titanlite.train --job.config_file FILE [--section.key value ...]`.

main() starts the process (launcher watch, preflight, process group), builds the Trainer
(titanlite/trainer.py: the model, its parallelism and one optimizer step) and runs it: a dry run's
report, a seed checkpoint, or `train`, the loop over steps (logging, validation, checkpoints).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from titanlite.config import JobConfig, parse_args
from titanlite.errors import ConfigError, TrainingDiverged
from titanlite.fault_tolerance import FaultToleranceFailed
from titanlite.goodput import GoodputClock, describe, process_start, read, report as goodput_report
from titanlite.health import GRACE, HangWatchdog, ReplicaCheck, ReplicaDiverged, Stragglers
from titanlite.metrics import log_line
from titanlite import preflight
from titanlite.profiling import Profiler
from titanlite.rollback import roll_back
from titanlite.torchrun import attempt, start_attempt, write_error
from titanlite.dtensors import local
from titanlite.trainer import Trainer


def init_distributed(config: JobConfig) -> torch.device:
    """Join the process group (nccl on CUDA, gloo on CPU); a plain `python -m` run is a world of 1."""
    init_timeout = config.comm.init_timeout_seconds
    plain = "RANK" not in os.environ
    if plain:
        os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", LOCAL_RANK="0")
        os.environ.setdefault("WORLD_SIZE", "1")
    if config.dry_run:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=int(os.environ["WORLD_SIZE"]))
        return torch.device("meta")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend = "nccl"
        enable_flight_recorder(config)
    else:
        device, backend = torch.device("cpu"), "gloo"
        reuse_freed_host_memory()
    if plain:
        # The store binds a port the kernel picks: a free port looked up first could be taken by another
        # process before the store binds it. MASTER_PORT then names it (torchft's Manager reads it).
        rank, world_size = 0, int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=init_timeout))
        os.environ["MASTER_PORT"] = str(store.port)
    else:
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timedelta(seconds=init_timeout)))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # The workers share torchrun's agent store, which outlives a restart and still holds the dead
        # attempt's gloo addresses: a prefix per attempt keeps the new ranks from waiting on them. (It
        # only works on one node: nodes count restarts apart. run_train.sh sets
        # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which gives every attempt a fresh store instead.)
        store = dist.PrefixStore(f"titanlite/attempt{attempt()}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=init_timeout))
    return device


def reuse_freed_host_memory() -> None:
    """On CPU, keep freed memory for the next step. glibc gives every block over 32 MiB (the logits and
    their gradients) back to the kernel when it is freed, and trims the heap's free top, so each step
    faults those pages in again and the kernel zeroes them: a fresh 64 MiB tensor costs 25 ms to fill,
    a reused one 2.5 ms. With mmap off and trimming off, blocks come from the heap and stay there (glibc
    still maps memory when the heap cannot grow). Other C libraries have no mallopt: nothing changes."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
        mallopt(M_MMAP_MAX, 0)
        mallopt(M_TRIM_THRESHOLD, -1)


def enable_flight_recorder(config: JobConfig) -> None:
    """NCCL's flight recorder ([comm] trace_buf_size): the last collectives of each rank, dumped on a
    timeout to <dump_folder>/<save_traces_folder>/<prefix><rank>."""
    c = config.comm
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(c.trace_buf_size))
    if c.trace_buf_size > 0:
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        folder = os.path.join(config.job.dump_folder, c.save_traces_folder)
        os.makedirs(folder, exist_ok=True)
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", os.path.join(folder, c.save_traces_file_prefix))


def exit_with_launcher() -> None:
    """torchrun starts each rank in a session of its own, so a rank outlives a launcher killed with
    SIGKILL (or a node's agent that died) and would train on beside the job that replaces it, writing
    into the same checkpoint folder. A rank that torchrun started exits once its launcher is gone."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-launcher", daemon=True).start()


def set_collective_timeout(seconds: int, keep=()) -> None:
    """After the first step (compilation, data setup done), a hang should fail fast. Groups in `keep`
    hold their own timeout (the async checkpoint's, whose writes of large shards take long)."""
    dist.barrier()
    for group in [None, *dist.distributed_c10d._world.pg_map]:
        if group not in keep:
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def shorten_collective_timeout(trainer: Trainer) -> None:
    """comm.train_timeout_seconds for training's groups (GRACE more under the hang watchdog, which then
    reports first); the async checkpoint keeps its own."""
    keep = [trainer.checkpointer.checkpoint_group] if trainer.checkpointer.checkpoint_group else []
    set_collective_timeout(trainer.config.comm.train_timeout_seconds + (GRACE if trainer.config.health.hang_watchdog else 0), keep)


def train(trainer: Trainer) -> None:
    """The run loop: resume, then step until training.steps, logging, validating and saving on their steps."""
    t, m, v = trainer.config.training, trainer.config.metrics, trainer.config.validation
    tokens_per_step = trainer.accumulation_steps * t.local_batch_size * t.seq_len
    log_line(
        f"{trainer.config.job.description}: model {trainer.config.model.name} {trainer.config.model.flavor}: {trainer.num_params:,} params, "
        f"{trainer.flops_per_token / 1e9:.3f} GFLOPs/token; layout {trainer.dims.describe()}; "
        f"{trainer.accumulation_steps} microbatch(es)/step; MFU peak {trainer.metrics.peak / 1e12:.2f} TFLOP/s "
        f"({trainer.metrics.peak_source}); device {trainer.device}"
        + (f"; J/token from power by {trainer.metrics.power[0]}" if trainer.metrics.power else "")
        + (f"; MoE: FLOPs, TFLOPS and MFU count the {trainer.active_params:,} parameters a token uses (its "
           "experts), not all" if trainer.is_moe else "")
    )
    if notes := trainer.model_parts[0].args.notes:  # the family's own (DeepSeek-V3: YaRN on)
        log_line(notes)
    for converter in trainer.converters:
        log_line(converter.describe(trainer.model_parts, trainer.device))
    if trainer.config.model.tokenizer_path:
        log_line("model.tokenizer_path is deprecated (TorchTitan v0.2): use model.hf_assets_path")
    if trainer.pp_schedule is not None:
        log_line(
            f"pipeline: {trainer.config.parallelism.pipeline_parallel_schedule}, this rank holds stages {trainer.stage_ids}; "
            "the loss is computed on the last stage and all-reduced over pp, so every rank logs it"
        )
    setup_end = time.time()
    resumed = trainer.checkpointer.load()
    clock = GoodputClock(trainer.metrics.folder, trainer.metrics.writes_files, process_start())
    clock.start(trainer.step, time.time() - setup_end, setup_end, fresh=not resumed and attempt() == 0)
    c = trainer.config.checkpoint
    biased = any(bool(layer.expert_bias.any()) for layer in trainer.moe_layers)
    # Asked of every rank (a pipeline stage may hold no MoE layer), so all stop here alike, not rank 0
    # alone when it converts the final save.
    if c.enable and c.last_save_in_hf and trainer.is_moe and not trainer.every_rank(not biased):
        raise ConfigError(
            "checkpoint.last_save_in_hf=true, but the loaded model's expert bias is not zero and Qwen3MoeForCausalLM "
            "has none: the export would route differently; set checkpoint.last_save_in_hf=false"
        )
    trainer.metrics.open(append=resumed)
    gc.disable()  # collect at fixed steps instead, so ranks don't stall at different times
    gc.collect()
    data_iter = iter(trainer.dataloader)
    loss = float("nan")
    trainer.profiler = Profiler(trainer.config, dist.get_rank(), trainer.device)
    redo = False  # the last step did not commit (fault tolerance): its batch again
    stragglers = Stragglers(trainer.config, trainer.metrics, trainer.hosts)
    replicas = ReplicaCheck(trainer.config, trainer.dims, trainer.metrics, trainer.hosts)
    watchdog = HangWatchdog(trainer.config, dist.get_rank(), trainer.hosts) if trainer.config.health.hang_watchdog else None
    trained = 0  # steps this process trained (not a resumed run's, not those of a peer it healed from)
    while trainer.step < t.steps:
        trainer.step += 1
        if watchdog:  # from the second step: the first compiles and sets up
            watchdog.at(trainer.step, 0, armed=trained > 0)
        if t.gc_debug:
            gc.collect()  # every step, every generation: memory held by reference cycles shows at once
        elif trainer.step % t.gc_freq == 0:
            gc.collect(1)
        data_start = time.perf_counter()
        if not redo:
            microbatches = trainer.batches.next(trainer, data_iter)
        data_seconds = time.perf_counter() - data_start
        trainer.injector.before_step(trainer.step, trainer.model_parts)
        stragglers.arrive(trainer.step, trainer.device)
        if watchdog:
            watchdog.at(trainer.step, 1, armed=False)
        step_start, skipped = time.perf_counter(), trainer.skipped_steps
        local_loss, grad_norm = trainer.train_step(microbatches)
        trainer.injector.after_step(trainer.step, trainer.parameters())
        replicas.check(trainer.step, trainer.parameters())
        redo = trainer.ft is not None and not trainer.ft.committed
        replayed_s = trainer.spikes.replay.take_seconds() if trainer.spikes and trainer.spikes.replay else 0.0
        clock.step(time.perf_counter() - step_start, data_seconds, not redo and trainer.skipped_steps == skipped, replayed_s)
        if redo:
            log_line(f"step {trainer.step} not committed (a replica group failed or healed in it): redone with the same batch")
            trainer.step -= 1
            continue
        trainer.tokens_seen += tokens_per_step * trainer.dp_degree
        trained += 1
        trainer.metrics.record_step(tokens_per_step, data_seconds)
        stragglers.check(trainer.step, step_start, trainer.device)
        last = trainer.step == t.steps
        # Only log, validation and checkpoint steps wait for the device (and reduce the loss).
        validating = v.enable and (trainer.step % v.freq == 0 or last)
        if validating or trainer.checkpointer.due(trainer.step, last):
            trainer.check_finite()  # never evaluate or save weights a non-finite step has touched
        log_step = trainer.step == 1 or trainer.step % m.log_freq == 0 or last
        if log_step:
            loss = trainer.global_loss(local_loss)
            trainer.check_finite(loss if trainer.skipped_steps == skipped else 0.0)  # a skipped step's loss moved no weight
            lr = trainer.lr_schedulers[0].get_last_lr()[0]
            skipped = trainer.skipped_steps if t.skip_nonfinite_steps or trainer.spikes else None
            trainer.metrics.log(trainer.step, loss, grad_norm.item(), lr, trainer.tokens_seen, skipped, trainer.step_extras())
        if watchdog:
            watchdog.at(trainer.step, 2, armed=False)  # validation and checkpoints are not timed
        if trainer.spikes and trainer.spikes.rollback:
            trainer.spikes.rollback = False
            set_collective_timeout(trainer.config.comm.init_timeout_seconds)  # a load and a save, timed as at start
            rolled_back = roll_back(trainer, clock)
            shorten_collective_timeout(trainer)
            if rolled_back is not None:
                data_iter = rolled_back
                continue
        if validating:
            began = time.perf_counter()
            trainer.metrics.log_validation(trainer.step, trainer.validate())
            trainer.metrics.reset()  # keep evaluation time out of the next throughput window
            clock.add("validation_s", time.perf_counter() - began)
        saving, began = trainer.checkpointer.due(trainer.step, last), time.perf_counter()
        trainer.checkpointer.maybe_save(trainer.step, last)
        if saving:
            clock.add("save_s", time.perf_counter() - began)
        if log_step or saving:
            clock.record(trainer.step, trainer.ft.metrics() if trainer.ft else None)
        trainer.profiler.after_step(trainer.step)
        if trained == 1:
            shorten_collective_timeout(trainer)
    began = time.perf_counter()
    trainer.checkpointer.wait()
    clock.add("save_s", time.perf_counter() - began)
    clock.record(trainer.step, trainer.ft.metrics() if trainer.ft else None, event="end")
    trainer.profiler.close()
    elapsed = time.perf_counter() - trainer.metrics.start
    tokens = trained * tokens_per_step * trainer.dp_degree
    log_line(
        f"done: {trainer.step} steps, final loss {loss:.4f}; this run: {trained} steps, "
        f"{tokens:,} tokens in {elapsed:.1f}s ({tokens / elapsed / trainer.dims.world_size:,.0f} tokens/s per device); "
        f"metrics in {trainer.metrics.folder / 'metrics.jsonl'}" + (f"; {trainer.ft.summary()}" if trainer.ft else "")
    )
    if trainer.metrics.writes_files:
        log_line(describe(goodput_report(read(trainer.metrics.folder))) + " (scripts/goodput.py plots it)")
    trainer.metrics.close()


def create_seed_checkpoint(trainer: Trainer) -> None:
    """The initial weights as step-0, written by one process so any layout can load the same start."""
    if trainer.dims.world_size != 1:
        raise ConfigError(
            f"checkpoint.create_seed_checkpoint=true runs on 1 process, not {trainer.dims.world_size}; use NGPU=1"
        )
    trainer.checkpointer.save(0, model_only=True, dtype=torch.float32)


def describe_dry_run(trainer: Trainer) -> None:
    """What each rank would hold, from the meta-device model: checks a big layout on a laptop."""
    held = sum(local(p).numel() for p in trainer.parameters())
    # fp32 params + grads + two Adam moments per local parameter.
    log_line(
        f"dry run OK: layout {trainer.dims.describe()}; model {trainer.num_params:,} params, "
        f"{held:,} on rank 0 (~{16 * held / 2**30:.1f} GiB of params, grads and AdamW states); "
        f"{trainer.flops_per_token / 1e9:.2f} GFLOPs/token"
    )


def record_config(config: JobConfig) -> None:
    """job.print_config and job.save_config_file: the resolved config as JSON."""
    text = json.dumps(config.to_dict(), indent=2)
    if config.job.print_config:
        log_line(f"config: {text}")
    if config.job.save_config_file:
        path = os.path.join(config.job.dump_folder, config.job.save_config_file)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text + "\n")
        log_line(f"config saved to {path}")


def report(message: str, code: int) -> int:
    """One line for the person who launched the run: printed, or left for titanlite.torchrun to print."""
    if not write_error(message, code):
        print(message, file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> None:
    code, trainer = 0, None
    exit_with_launcher()
    start_attempt()
    try:
        config = parse_args(argv)
        if config.dry_run and int(os.environ.get("RANK", "0")) > 0:
            os._exit(0)  # a dry run is one process's work; torchrun (a TOML's comm.mode) started more
        preflight.check(config, int(os.environ.get("WORLD_SIZE", "1")))  # bad input stops every rank before any collective
        device = init_distributed(config)
        trainer = Trainer(config, device)
        if dist.get_rank() == 0:
            record_config(config)
        if config.dry_run:
            describe_dry_run(trainer)
        else:
            if dist.get_rank() == 0:
                config.save(trainer.metrics.folder / "config.toml")
            if config.checkpoint.create_seed_checkpoint:
                create_seed_checkpoint(trainer)
            else:
                train(trainer)
        dist.barrier()
    except ConfigError as e:
        code = report(f"titanlite: config error: {e}", 2)
    except FaultToleranceFailed as e:
        code = report(f"titanlite: {e}", 1)
    except ReplicaDiverged as e:
        code = report(f"titanlite: {e}", 1)
    except TrainingDiverged as e:
        if trainer is not None:
            trainer.checkpointer.wait()  # an async save in flight was checked when it started: let it land
        code = report(f"titanlite: {e}", 1)
    finally:
        if trainer is not None and trainer.ft:
            trainer.ft.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
    # os._exit: gloo worker threads can abort the interpreter's shutdown (docs/architecture.md, "gloo on CPU").
    os._exit(code)


if __name__ == "__main__":
    main()

"""Cross-key checks of a config that need no torch and no world size (layout checks live in
ParallelDims; a model family's own checks in its folder, called through the registry)."""

from __future__ import annotations

import re

from titanlite.config.keys import LEAVES, default_value, get
from titanlite.config.quantize import FLOAT8_CONVERTERS, float8_recipe
from titanlite.config.schema import JobConfig
from titanlite.errors import ConfigError
from titanlite.models import FAMILIES
from titanlite.models.common.args import with_overrides


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_not_implemented(config: JobConfig) -> None:
    """A TorchTitan key titanlite does not implement is accepted only at its default."""
    for key, (f, _) in LEAVES.items():
        instead = f.metadata["not_implemented"]
        value, default = get(config, key), default_value(f)
        if instead and value != default and not (value in (None, "") and default in (None, "")):
            raise ConfigError(
                f"{key}={get(config, key)!r} is not implemented in titanlite (a TorchTitan key, accepted only at its "
                f"default {default_value(f)!r}); {instead}"
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
    mask_type = config.model.attn_mask_type or flavors[config.model.flavor].attn_mask_type
    _require(
        not config.model.reset_position_ids or mask_type == "block_causal",
        f"model.reset_position_ids=true restarts RoPE positions at each document, but attention is {mask_type} over the "
        "whole window; set model.attn_mask_type='block_causal', or reset_position_ids=false",
    )
    # The flavor's shapes as the config changes them: the family checks its own [model] keys against them.
    args = with_overrides(flavors[config.model.flavor], config.model.flavor_overrides)
    FAMILIES[config.model.name].check_config(config.model, args)
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
        ("training.loss_chunks", t.loss_chunks),
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
    _require(
        t.loss_chunks == 1 or p.tensor_parallel_degree == 1 or not p.disable_loss_parallel,
        f"training.loss_chunks={t.loss_chunks} with parallelism.disable_loss_parallel=true: under TP the chunked loss "
        "splits the vocabulary over tp ranks as loss parallel does; set disable_loss_parallel=false or loss_chunks=1",
    )
    _require(m.peak_flops >= 0, f"metrics.peak_flops={m.peak_flops} must be >= 0 (0 = automatic)")
    _require(config.model.n_layers >= 0, f"model.n_layers={config.model.n_layers} must be >= 0 (0 = the flavor's)")
    _require(m.gpu_hour_cost >= 0, f"metrics.gpu_hour_cost={m.gpu_hour_cost} must be >= 0 (dollars; 0 = off)")
    converters = config.model.converters
    _require(
        len(set(converters)) == len(converters) and len(set(FLOAT8_CONVERTERS) & set(converters)) <= 1,
        f"model.converters={converters} names a converter twice ('float8' is 'quantize.linear.float8'); list each once",
    )
    if "quantize.grouped_mm.float8" in converters:
        fqns = config.quantize.grouped_mm.float8.fqns
        _require(bool(fqns), "model.converters has 'quantize.grouped_mm.float8' but quantize.grouped_mm.float8.fqns is empty; "
                 "name the MoE modules, e.g. --quantize.grouped_mm.float8.fqns experts")
        _require(
            p.expert_tensor_parallel_degree == 1,
            f"quantize.grouped_mm.float8 with expert_tensor_parallel_degree={p.expert_tensor_parallel_degree}: expert TP "
            "splits the experts' hidden dim, which float8's rowwise scales run along; set expert_tensor_parallel_degree=1",
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
    o = config.optimizer
    _require(o.momentum >= 0, f"optimizer.momentum={o.momentum} must be >= 0")
    _require(1 <= o.ns_steps < 100, f"optimizer.ns_steps={o.ns_steps} must be between 1 and 99")
    for name in ("adamw_lr", "adamw_weight_decay"):
        value = getattr(o, name)
        _require(value is None or value >= 0, f"optimizer.{name}={value} must be >= 0")
    h, injection = config.health, config.fault_injection
    _require(h.spike_window >= 2, f"health.spike_window={h.spike_window} must be >= 2 (steps of history)")
    _require(h.spike_sigmas > 0, f"health.spike_sigmas={h.spike_sigmas} must be > 0 (standard deviations above the mean)")
    _require(h.straggler_interval >= 0, f"health.straggler_interval={h.straggler_interval} must be >= 0 (0 = off)")
    _require(h.straggler_percent > 0, f"health.straggler_percent={h.straggler_percent} must be > 0")
    _require(h.replica_check_interval >= 0, f"health.replica_check_interval={h.replica_check_interval} must be >= 0 (0 = off)")
    _require(h.straggler_checks >= 1, f"health.straggler_checks={h.straggler_checks} must be >= 1")
    _require(h.rollback_batches >= 1, f"health.rollback_batches={h.rollback_batches} must be >= 1 (the spike's batch at least)")
    _require(h.max_rollbacks >= 0, f"health.max_rollbacks={h.max_rollbacks} must be >= 0")
    if h.spike_policy == "rollback":
        _require(config.checkpoint.enable, "health.spike_policy='rollback' with checkpoint.enable=false: a rollback goes "
                 "back to a checkpoint; set checkpoint.enable=true or use spike_policy='skip'")
        _require(not config.fault_tolerance.enable, "health.spike_policy='rollback' with fault_tolerance.enable: each "
                 "replica group would roll back alone; use spike_policy='warn' or turn fault tolerance off")
    if h.replay:
        _require(h.spike_policy != "off", "health.replay=true with health.spike_policy='off': a replay runs on a spike; "
                 "set spike_policy='skip' (or warn, rollback)")
        _require(not config.fault_tolerance.enable, "health.replay=true with fault_tolerance.enable: a replica group "
                 "cannot replay a step alone; turn one of them off")
    for text in h.skip_batches:
        _require(re.fullmatch(r"[1-9]\d*(-[1-9]\d*)?", text) and int(text.split("-")[0]) <= int(text.split("-")[-1]),
                 f"health.skip_batches entry '{text}' is not a batch (7) or a range of them (7-9, first <= last, from 1)")
    _require(injection.step >= 1 and injection.steps >= 1, f"fault_injection.step={injection.step} and steps={injection.steps} must be >= 1")
    _require(injection.seconds >= 0, f"fault_injection.seconds={injection.seconds} must be >= 0")
    _require(0 <= injection.bit < 32, f"fault_injection.bit={injection.bit} must be a bit of a float32: 0..31")
    clip = f"optimizer.qk_clip_threshold={o.qk_clip_threshold}"
    _require(o.qk_clip_threshold >= 0, f"{clip} must be >= 0 (0 = off)")
    if o.qk_clip_threshold:
        _require(o.name == "Muon", f"{clip} with optimizer.name='{o.name}': QK-clip is MuonClip's; use Muon or set it to 0")
        _require(config.parallelism.context_parallel_degree == 1,
                 f"{clip} with parallelism.context_parallel_degree={config.parallelism.context_parallel_degree}: context "
                 "parallel's ring attention cannot report each head's largest logit; set it to 0 or turn context parallel off")
        _require(not config.fault_tolerance.enable, f"{clip} with fault_tolerance.enable: each replica group would clip by "
                 "its own data and the replicas drift apart; set it to 0 or turn fault tolerance off")
    _require(
        not (o.name == "Muon" and t.enable_cpu_offload),
        "optimizer.name='Muon' with training.enable_cpu_offload=true: Muon gathers each matrix over the process group, "
        "which cannot reach offloaded (host) shards; use AdamW with offload, or turn offload off",
    )
    for key, settings in (("training", t), ("validation", v)):
        _require(
            not (settings.dataset_mixture and settings.dataset_path),
            f"{key}.dataset_mixture and {key}.dataset_path='{settings.dataset_path}' are both set; the mixture names "
            "its own paths: drop one",
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
    check_fault_tolerance(config)
    check_semi_sync(config, args.n_layers)


def check_fault_tolerance(config: JobConfig) -> None:
    """torchft replica groups: each group is its own torchrun job and torchft owns the replicate dim."""
    ft = config.fault_tolerance
    if not ft.enable:
        return
    _require(ft.group_size >= 1, f"fault_tolerance.group_size={ft.group_size} must be >= 1 (the number of replica groups)")
    _require(
        0 <= ft.replica_id < ft.group_size,
        f"fault_tolerance.replica_id={ft.replica_id} is outside 0 .. group_size - 1 = {ft.group_size - 1}; "
        "give each replica group its own id below group_size",
    )
    _require(
        1 <= ft.min_replica_size <= ft.group_size,
        f"fault_tolerance.min_replica_size={ft.min_replica_size} must be between 1 and group_size={ft.group_size}",
    )
    _require(
        config.debug.seed is not None,
        "fault_tolerance.enable=true needs debug.seed: every replica group must initialize the same weights; set "
        "debug.seed to one number for all groups",
    )
    _require(ft.process_group_timeout_ms >= 1, f"fault_tolerance.process_group_timeout_ms={ft.process_group_timeout_ms} must be >= 1")
    _require(
        config.parallelism.data_parallel_replicate_degree == 1,
        f"parallelism.data_parallel_replicate_degree={config.parallelism.data_parallel_replicate_degree} with "
        "fault_tolerance.enable=true: torchft's replica groups are the replicate dim; set it to 1 and start "
        "fault_tolerance.group_size groups",
    )


def check_semi_sync(config: JobConfig, n_layers: int) -> None:
    """LocalSGD and (streaming) DiLoCo: torchft's schedule, checked before launch."""
    ft = config.fault_tolerance
    if not (ft.enable and ft.semi_sync_method):
        return
    method = f"fault_tolerance.semi_sync_method='{ft.semi_sync_method}'"
    _require(ft.sync_steps >= 1, f"fault_tolerance.sync_steps={ft.sync_steps} must be >= 1 (inner steps between syncs)")
    _require(
        config.parallelism.pipeline_parallel_degree == 1,
        f"{method} with parallelism.pipeline_parallel_degree={config.parallelism.pipeline_parallel_degree}: a semi-sync "
        "group keeps one optimizer per rank here; set pipeline_parallel_degree=1 or semi_sync_method to none",
    )
    _require(
        not config.training.skip_nonfinite_steps,
        f"training.skip_nonfinite_steps=true with {method}: a group that skips a step alone would reach its sync a "
        "step after the others; set it to false",
    )
    c = config.checkpoint
    _require(
        not c.enable or c.interval % ft.sync_steps == 0,
        f"checkpoint.interval={c.interval} with {method}: a checkpoint resumes the sync schedule from a sync; make "
        f"the interval a multiple of fault_tolerance.sync_steps={ft.sync_steps}",
    )
    _require(
        not (c.enable and c.enable_first_step_checkpoint),
        f"checkpoint.enable_first_step_checkpoint=true with {method}: step 1 is between syncs, where a checkpoint "
        "cannot resume the sync schedule; set it to false",
    )
    fragments = len(ft.module_fqns_per_model_fragment) or ft.num_fragments
    if ft.semi_sync_method == "local_sgd":
        _require(
            fragments == 1,
            f"fault_tolerance.num_fragments={fragments} with {method}: fragments are DiLoCo's; set num_fragments=1 or use diloco",
        )
        return
    _require(
        1 <= fragments <= n_layers,
        f"fault_tolerance.num_fragments={fragments} must be between 1 and the model's {n_layers} blocks "
        "(each fragment holds whole blocks)",
    )
    _require(
        ft.sync_steps % fragments == 0,
        f"fault_tolerance.sync_steps={ft.sync_steps} must be a multiple of num_fragments={fragments} "
        "(one fragment syncs every sync_steps / num_fragments steps)",
    )
    _require(
        0 <= ft.fragment_sync_delay < ft.sync_steps // fragments,
        f"fault_tolerance.fragment_sync_delay={ft.fragment_sync_delay} must be between 0 and sync_steps / num_fragments - 1 = "
        f"{ft.sync_steps // fragments - 1}: a fragment's all-reduce must land before its next one starts",
    )
    _require(
        0.0 <= ft.fragment_update_alpha <= 1.0,
        f"fault_tolerance.fragment_update_alpha={ft.fragment_update_alpha} must be between 0 (the synced weights) and 1 (the local ones)",
    )

"""The sections of a run that survives: `[fault_tolerance]` (TorchTitan v0.2.2's torchft keys) and
titanlite's own `[health]` (loss spikes, stragglers, hangs: titanlite/health.py) and `[fault_injection]`
(a drill: one fault at one step on one rank, titanlite/fault_injection.py)."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.config.fields import opt


@dataclass
class FaultTolerance:
    enable: bool = opt(False, "torchft replica groups: each its own torchrun job; a failed group drops out, the rest go on")
    process_group: str = opt("gloo", "torchft's process group between replica groups", ("gloo", "nccl"))
    process_group_timeout_ms: int = opt(10000, "torchft's collective and Lighthouse timeout")
    replica_id: int = opt(0, "this replica group's id, 0 .. group_size - 1")
    group_size: int = opt(0, "how many replica groups the job has")
    min_replica_size: int = opt(1, "fewest replica groups that may commit a step")
    semi_sync_method: str | None = opt(
        None, "local_sgd or diloco: groups train apart and meet every sync_steps steps; none = gradients every step",
        choices=("local_sgd", "diloco", None),
    )
    # torchtitan/components/ft/config: the keys TorchTitan's FT experiment adds.
    sync_steps: int = opt(5, "local_sgd/diloco: inner steps between syncs")
    should_quantize: bool = opt(False, "diloco: all-reduce the pseudo-gradients in float8 (torchft; needs triton, a GPU)")
    fragment_sync_delay: int = opt(0, "streaming diloco: inner steps a fragment's all-reduce runs before it is waited for")
    fragment_update_alpha: float = opt(0.0, "streaming diloco: share of the local weights kept at a sync (0 = the global ones)")
    module_fqns_per_model_fragment: list[list[str]] = opt(
        [], "diloco fragments by module name, e.g. [[\"tok_embeddings\", \"layers.0\"], [\"layers.1\", \"norm\", \"output\"]]; "
        "empty = num_fragments runs of consecutive blocks"
    )
    num_fragments: int = opt(1, "streaming diloco: fragments synced in turn, sync_steps / num_fragments steps apart")


@dataclass
class Health:
    spike_policy: str = opt(
        "skip", "a step whose loss or grad norm is far above its recent history: skip (no optimizer update, as "
        "OLMo-core does), rollback (back to the newest checkpoint before the rollback_batches batches that led "
        "into it, which are skipped from then on, as PaLM did), warn (named, the update kept) or off",
        choices=("skip", "warn", "off", "rollback"), extension=True,
    )
    rollback_batches: int = opt(20, "rollback: the batches skipped, the spike's and those before it", extension=True)
    max_rollbacks: int = opt(5, "rollback: a spike after this many rollbacks (in one process) stops the run", extension=True)
    skip_batches: list[str] = opt(
        [], "global batches never trained on, as ranges (1-based, counting skipped ones): e.g. 8-9,120 gives the run "
        "a rollback that skipped batches 8 and 9 and one at 120 would give; a rollback adds its own", extension=True,
    )
    replay: bool = opt(
        False, "a spike or a non-finite step runs again on the same data before its update (Megatron's rerun, in "
        "process): a replay that differs bitwise is a transient fault (rank named, the replay's result kept); one that "
        "reproduces is recomputed on the next data-parallel rank: the same bits are the data (the step is skipped or "
        "per spike_policy), others a persistent fault (rank named, the run stops)", extension=True,
    )
    spike_window: int = opt(100, "steps of history a spike is measured against (checks start at half of it)", extension=True)
    spike_sigmas: float = opt(6.0, "far above: past the window's mean + this many standard deviations", extension=True)
    straggler_interval: int = opt(
        50, "every N steps each rank's lateness at the step's start is gathered (one small all-gather); 0 = off", extension=True
    )
    straggler_percent: float = opt(20.0, "a rank later than the median by this share of the median step time ...", extension=True)
    straggler_checks: int = opt(3, "... in this many checks in a row is named", extension=True)
    replica_check_interval: int = opt(
        100, "under HSDP or DDP: every N steps each rank's checksum of its weights' bits is compared across its "
        "replicas (one all-gather of a number per parameter); 0 = off", extension=True,
    )
    replica_check_action: str = opt(
        "heal", "a replica that differs: named, then heal (the weights sent from a healthy replica) or stop (one line, exit 1)",
        choices=("heal", "stop"), extension=True,
    )
    hang_watchdog: bool = opt(
        True, "a step past comm.train_timeout_seconds: every rank's Python stack to dump_folder/hang, the ranks "
        "behind named, exit 1 (torchrun or torchft restarts)", extension=True,
    )


@dataclass
class FaultInjection:
    kind: str = opt(
        "", "a drill: the fault to inject at `step` on `rank` ('' = none)",
        choices=("", "nan_batch", "spike_batch", "spike_rank", "bitflip_grad", "bitflip_param", "slow", "hang"), extension=True,
    )
    step: int = opt(1, "the step it strikes", extension=True)
    rank: int = opt(0, "the rank it strikes (global rank)", extension=True)
    steps: int = opt(1, "slow: for this many steps from `step`", extension=True)
    seconds: float = opt(2.0, "slow: seconds each of those steps is held back", extension=True)
    spike_factor: float = opt(100.0, "spike_batch, spike_rank: the factor the logits are multiplied by", extension=True)
    bit: int = opt(30, "bitflip_*: the bit of one float32 element flipped (30: the exponent's top)", extension=True)

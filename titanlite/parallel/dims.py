"""ParallelDims: the parallel degrees, their checks, and ONE DeviceMesh with named dims.

Mesh dims, outermost to innermost: pp, dp_replicate, dp_shard, cp, tp, where dp_shard is laid out
as two dims, efsdp x dp_shard_in_ep, so that expert parallel can borrow ranks without a mesh of its
own (efsdp = dp_shard / dp_shard_in_ep; both are 1 and dp_shard without expert parallel).
Derived (flattened) views:
  batch    = dp_replicate x dp_shard   ranks that read different data
  loss     = dp_replicate x dp_shard x cp   ranks whose token counts and losses are summed
  fsdp     = dp_shard x cp   ranks that FSDP shards parameters over
  routing  = dp_replicate x dp_shard x cp x tp   ranks that route different tokens through MoE layers:
             under tensor parallel (with sequence parallel) each tp rank routes its sequence shard
  moe_fsdp = dp_shard x cp x tp   where FSDP shards a MoE layer's own weights: tp ranks saw other tokens
  sequence = cp x tp   ranks that hold parts of the same sequences
  ep       = dp_shard_in_ep x cp (x tp, unless expert TP splits the experts over tp)   ranks that
             split the routed experts (expert_parallel_degree > 1)
  efsdp      the routing ranks outside EP: FSDP shards EP's experts over them (with dp_replicate: HSDP;
             expert TP without EP shards over fsdp instead)
Components ask `get_mesh(name)` instead of building groups of their own.
The checks are plain Python so run_train.sh can run them before torchrun starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlite.config import JobConfig
from titanlite.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "efsdp", "dp_shard_in_ep", "cp", "tp")
DERIVED = {
    "batch": ("dp_replicate", "efsdp", "dp_shard_in_ep"),
    "loss": ("dp_replicate", "efsdp", "dp_shard_in_ep", "cp"),
    "fsdp": ("efsdp", "dp_shard_in_ep", "cp"),
    "routing": ("dp_replicate", "efsdp", "dp_shard_in_ep", "cp", "tp"),
    "moe_fsdp": ("efsdp", "dp_shard_in_ep", "cp", "tp"),
    "sequence": ("cp", "tp"),
}


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    ep: int = 1
    sequence_parallel: bool = True  # under tp > 1: activations between blocks sharded along the sequence
    etp: int = 1  # expert tensor parallel: 1 (experts whole) or tp (each expert's hidden dim split over tp)
    _meshes: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, config: JobConfig, world_size: int) -> "ParallelDims":
        p = config.parallelism
        dp_replicate, tp, pp, cp = (
            p.data_parallel_replicate_degree,
            p.tensor_parallel_degree,
            p.pipeline_parallel_degree,
            p.context_parallel_degree,
        )
        others = dp_replicate * cp * tp * pp
        dp_shard = p.data_parallel_shard_degree
        layout = f"dp_replicate={dp_replicate} cp={cp} tp={tp} pp={pp}"
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"parallelism degrees ({layout}, product {others}) do not divide the world size {world_size}; "
                    "choose degrees whose product divides the number of ranks"
                )
            dp_shard = world_size // others
        if dp_shard * others != world_size:
            raise ConfigError(
                f"parallelism degrees (dp_shard={dp_shard} {layout}) multiply to {dp_shard * others}, "
                f"not the world size {world_size}; set parallelism.data_parallel_shard_degree=-1 or fix the degrees"
            )
        dims = cls(
            dp_replicate, dp_shard, cp, tp, pp, world_size, p.expert_parallel_degree, p.enable_sequence_parallel,
            p.expert_tensor_parallel_degree,
        )
        dims.check_expert_parallel()
        t, v = config.training, config.validation
        dims.check_sequence("training.seq_len", t.seq_len)
        if v.enable:
            dims.check_sequence("validation.seq_len", v.seq_len)
            if pp > 1 and (v.local_batch_size, v.seq_len) != (t.local_batch_size, t.seq_len):
                raise ConfigError(
                    f"validation.local_batch_size={v.local_batch_size} and validation.seq_len={v.seq_len} must equal "
                    f"training's ({t.local_batch_size}, {t.seq_len}) under pipeline parallel (the schedule's stages "
                    "have fixed shapes); set them equal"
                )
        return dims

    def check_expert_parallel(self) -> None:
        """EP borrows all of cp, part of dp_shard and, unless expert TP splits the experts over tp, tp:
        ep = dp_shard_in_ep x cp (x tp). TorchTitan's two choices of expert_tensor_parallel_degree: 1 or tp."""
        if self.etp > 1 and self.tp == 1:
            raise ConfigError(
                f"parallelism.expert_tensor_parallel_degree={self.etp} splits each expert over the tensor-parallel "
                f"ranks, but tensor_parallel_degree=1; set expert_tensor_parallel_degree=1, or tensor_parallel_degree={self.etp}"
            )
        if self.etp not in (1, self.tp):
            raise ConfigError(
                f"parallelism.expert_tensor_parallel_degree={self.etp} must be 1 (experts whole; expert parallel "
                f"borrows the tp ranks) or tensor_parallel_degree={self.tp} (each expert split over tp)"
            )
        ep, inner = self.ep, self.ep_inner
        key = f"parallelism.expert_parallel_degree={ep}"
        if ep < 1:
            raise ConfigError(f"{key} must be >= 1 (1 = no expert parallel)")
        if ep > 1 and (ep % inner or self.dp_shard % (ep // inner)):
            borrowed = "context_parallel_degree x tensor_parallel_degree" if self.etp == 1 else "context_parallel_degree"
            raise ConfigError(
                f"{key} must be {borrowed}={inner} times a divisor of "
                f"data_parallel_shard_degree={self.dp_shard} (expert parallel borrows those ranks); choose one of "
                f"{', '.join(str(inner * d) for d in range(1, self.dp_shard + 1) if self.dp_shard % d == 0)}"
            )

    @property
    def ep_inner(self) -> int:
        """The ranks EP takes whole: cp, and tp unless the experts are split over tp."""
        return self.cp * (self.tp if self.etp == 1 else 1)

    @property
    def expert_parallel_dims(self) -> tuple[str, ...]:
        return ("dp_shard_in_ep", "cp") + (("tp",) if self.etp == 1 else ())

    @property
    def expert_mesh_dims(self) -> tuple[str, ...] | None:
        """The mesh ExpertParallel takes ("ep", "tp", or both), None when the experts are not split."""
        dims = (("ep",) if self.ep > 1 else ()) + (("tp",) if self.etp > 1 else ())
        return dims or None

    @property
    def expert_fsdp_dim(self) -> str:
        """Where FSDP shards split experts: the routing ranks outside EP and expert TP. EP covers cp
        (and tp unless expert TP does), so that is efsdp; without EP, experts split by tp alone
        shard over dp_shard x cp."""
        return "efsdp" if self.ep > 1 else "fsdp"

    @property
    def dp_shard_in_ep(self) -> int:
        return self.ep // self.ep_inner if self.ep > 1 else 1

    @property
    def efsdp(self) -> int:
        return self.dp_shard // self.dp_shard_in_ep

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def check_sequence(self, key: str, seq_len: int) -> None:
        divisor = self.seq_len_divisor
        if seq_len % divisor:
            raise ConfigError(
                f"{key}={seq_len} must be divisible by {divisor} (tp={self.tp} x 2 x cp={self.cp}); "
                f"use a multiple of {divisor}"
            )

    def accumulation_steps(self, local_batch_size: int, global_batch_size: int) -> int:
        """Microbatches per optimizer step: the global batch over (local batch x data-parallel ranks)."""
        per_step = local_batch_size * self.dp_degree
        global_batch = per_step if global_batch_size == -1 else global_batch_size
        if global_batch % per_step:
            raise ConfigError(
                f"training.global_batch_size={global_batch} is not a multiple of local_batch_size x dp "
                f"= {local_batch_size} x {self.dp_degree}; use a multiple of {per_step}"
            )
        return global_batch // per_step

    @property
    def seq_len_divisor(self) -> int:
        """Sequence parallel splits the sequence over tp; load-balanced CP splits it into 2*cp chunks."""
        return self.tp * (2 * self.cp if self.cp > 1 else 1)

    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate * self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that share one stream of tokens: tokens/s per device divides by this."""
        return self.cp * self.tp * self.pp

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        dims = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        return " x ".join(f"{n}={getattr(self, n)}" for n in dims) + (f", ep={self.ep}" if self.ep_enabled else "") + (
            f", etp={self.etp}" if self.etp > 1 else ""
        ) + (
            f" (world {self.world_size})"
        )

    def build_mesh(self, device_type: str):
        """Create the world mesh (pp, dp_replicate, efsdp, dp_shard_in_ep, cp, tp) and its flattened views."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(getattr(self, n) for n in MESH_DIMS)
        world = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        self._meshes = {"world": world}
        views = DERIVED | ({"ep": self.expert_parallel_dims} if self.ep_enabled else {})
        for name, dims in views.items():
            # Keep the handle _flatten returns: slicing flattened names from the root is deprecated.
            self._meshes[name] = world[dims]._flatten(name)
        return world

    def get_mesh(self, name: str | tuple[str, ...]):
        """A named 1-D dim ('tp'), a derived view ('batch', 'loss', 'fsdp', 'routing', 'ep', ...), or a tuple of dims."""
        if not self._meshes:
            raise RuntimeError("ParallelDims.build_mesh() must run before get_mesh()")
        if name in self._meshes:
            return self._meshes[name]
        return self._meshes["world"][name]

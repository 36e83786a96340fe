"""Fitting the cost model to published runs: the runs of docs/published_runs.jsonl as the planner
sees them, the loss the fit minimizes, and the fit itself, which sets the FITTED constants where
`estimate` reads them (cost_model's module globals)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from titanlite.hardware import GPU
from titanlite.models.common.args import ModelArgs, MoEArgs
from titanlite.planner import cost_model
from titanlite.planner.cost_model import FITTED, MOE_FITTED, UNFITTED, UPPER_BOUNDS, Estimate, Layout, estimate


@dataclass(frozen=True)
class PublishedRun:
    """A measured run of docs/published_runs.jsonl, as the planner sees it."""

    id: str
    name: str
    model: ModelArgs
    seq_len: int
    global_batch: int
    gpu: GPU
    layout: Layout
    power_watts: float | None
    software: str
    values_padded: bool  # MLA's values padded to the query/key head dim (shapes.py): not under TE's attention
    tokens_per_second_per_gpu: float
    holdout: bool  # not used to fit the constants
    excluded: str | None  # why the run is shown but neither fitted nor counted in the error

    def estimate(self) -> Estimate:
        return estimate(self.model, self.seq_len, self.global_batch, self.gpu, self.layout, power_watts=self.power_watts,
                        software=self.software, values_padded=self.values_padded)

    @property
    def error(self) -> float:
        """Predicted tokens/s per GPU over measured, minus 1."""
        return self.estimate().tokens_per_second_per_gpu / self.tokens_per_second_per_gpu - 1


def published_runs(path) -> list[PublishedRun]:
    """The runs of a published_runs.jsonl: shapes (a family's flavor with its `overrides`, or a dense
    shape: a non-gated MLP as the SwiGLU with its weights), layouts (Megatron's data parallel with its
    distributed optimizer as ZeRO-1 replicas)."""
    import json
    from dataclasses import replace

    from titanlite.hardware import find_gpu
    from titanlite.models import model_args

    runs = []
    for line in open(path):
        r = json.loads(line)
        if "flavor" in r:
            model = replace(model_args(r.get("family", "moe"), r["flavor"], 0, r["seq"]), **r.get("overrides", {}))
        else:
            shape = r["shape"]
            ffn = shape["ffn_hidden"] if shape["gated"] else 2 * shape["ffn_hidden"] // 3
            model = ModelArgs(dim=shape["dim"], n_layers=shape["n_layers"], n_heads=shape["n_heads"], n_kv_heads=shape["n_kv_heads"],
                              vocab_size=shape["vocab"], multiple_of=ffn, ffn_dim_multiplier=None)
        dp = r["dp"]
        data = dict(dp_shard=dp) if r["dp_kind"] == "fsdp" else dict(dp_replicate=dp, zero1=r["dp_kind"] == "zero1")
        layout = Layout(tp=r["tp"], pp=r["pp"], vp=r["vp"], cp=r["cp"], ep=r["ep"], microbatch=r["microbatch"], ac=r["recompute"],
                        float8=r["float8"], tp_overlap=r["tp_overlap"], compile=r.get("compile", False),
                        sp_regather=r["framework"] == "megatron" and r["tp"] > 1, ep_dedup=r.get("ep_dedup", False),
                        ep_overlap=r.get("ep_overlap", False), cp_allgather=r.get("cp_allgather", False),
                        accumulation=r.get("accumulation", 1), last_stage_blocks=r.get("last_stage_blocks", 0), **data)
        runs.append(PublishedRun(
            r["id"], f"{r['framework']} {r['model']}, {r['gpus']} {r['gpu']}", model, r["seq"], r["global_batch"], find_gpu(r["gpu"]),
            # NeMo AutoModel trains with FSDP2, as TorchTitan does.
            layout, r["power_w"], "torchtitan" if r["framework"] == "automodel" else r["framework"],
            # Transformer Engine's attention (Megatron's, NeMo AutoModel's) takes MLA's values unpadded.
            r["framework"] not in ("megatron", "automodel"), r["tokens_per_s_per_gpu"], r["holdout"], r.get("excluded"),
        ))
    return runs


def fit_loss(runs: list[PublishedRun]) -> float:
    """What the fit minimizes: the mean |log(predicted / measured)|, plus half the worst one (a plan is
    judged by its worst miss as well as its typical one)."""
    errors = [abs(math.log(1 + r.error)) for r in runs]
    return sum(errors) / len(errors) + 0.5 * max(errors)


def fit_constants(runs: list[PublishedRun], rounds: int = 10, restarts: int = 0, seed: int = 0) -> dict:
    """Set FITTED's constants to those that minimize `fit_loss`, in two stages: those every run reads,
    over the dense runs; then MOE_FITTED's, which only MoE blocks read, over the MoE runs with the
    others held (the few MoE runs must not move what the many dense ones determine). Each stage:
    coordinate descent from the current values (relative steps of 20%, 5% and 1%, shares kept at
    most 1), then from `restarts` starts that perturb the best so far by about 15% each (seeded),
    keeping the best. Returns their values."""
    dense_names = tuple(name for name in FITTED if name not in MOE_FITTED)
    for names, stage_runs in ((dense_names, [r for r in runs if not isinstance(r.model, MoEArgs)]),
                              (MOE_FITTED, [r for r in runs if isinstance(r.model, MoEArgs)])):
        if stage_runs:
            fit_stage(names, stage_runs, rounds, restarts, seed)
    return {name: getattr(cost_model, name) for name in FITTED}


def fit_stage(names: tuple[str, ...], runs: list[PublishedRun], rounds: int, restarts: int, seed: int) -> None:
    """Coordinate descent (and seeded restarts) of the constants `names` over `runs`; see fit_constants."""
    import random

    module = cost_model  # the constants live where estimate() reads them
    keys = []
    for name in names:
        value = getattr(module, name)
        keys += [(name, key) for key in value if (name, key) not in UNFITTED] if isinstance(value, dict) else [(name, None)]

    def get(name, key):
        return getattr(module, name)[key] if key else getattr(module, name)

    def put(name, key, value):
        if key:
            getattr(module, name)[key] = value
        else:
            setattr(module, name, value)

    def descend() -> float:
        best = fit_loss(runs)
        for _ in range(rounds):
            for name, key in keys:
                for step in (0.2, 0.05, 0.01):
                    while True:
                        value = get(name, key)
                        for candidate in (value * (1 + step), value * (1 - step)):
                            if candidate > UPPER_BOUNDS.get(name, math.inf):
                                continue
                            put(name, key, candidate)
                            loss = fit_loss(runs)
                            if loss < best - 1e-9:
                                best = loss
                                break
                            put(name, key, value)
                        else:
                            break
        return best

    best_loss, rng = descend(), random.Random(seed)
    best = {k: get(*k) for k in keys}
    for _ in range(restarts):
        for k, value in best.items():
            put(*k, min(value * math.exp(rng.gauss(0, 0.15)), UPPER_BOUNDS.get(k[0], math.inf)))
        loss = descend()
        if loss < best_loss:
            best_loss, best = loss, {k: get(*k) for k in keys}
    for k, value in best.items():
        put(*k, value)

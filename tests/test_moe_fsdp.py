"""FSDP of routed experts on 4 gloo ranks: where the ranks outnumber a rank's experts they are
sharded along dim 1 (dim 0 would pad each rank to a whole expert), and each block's forward starts
the next block's expert all-gather with its own. Their losses and gradients are parity cases."""

import pytest

from distributed import run_distributed


def _experts_units(num_experts: int) -> tuple:
    from dataclasses import replace

    from torch.distributed.fsdp import FSDPModule

    from titanlite.config import parse_args
    from titanlite.models import FAMILIES, build_model, model_args
    from titanlite.parallel.dims import ParallelDims
    from titanlite.parallel.parallelize import parallelize

    config = parse_args(["--model.name", "moe", "--model.flavor", "debugmoe", "--parallelism.expert_parallel_degree", "2",
                         "--training.mixed_precision_param", "float32"])
    dims = ParallelDims.from_config(config, 4)
    dims.build_mesh("cpu")
    plan = FAMILIES["moe"].plan
    model = build_model("moe", replace(model_args("moe", "debugmoe", 256, 32), num_experts=num_experts))
    parallelize(model, plan, dims, config, "cpu")
    placements = {name: [str(pl) for pl in p.placements] for name, p in model.named_parameters() if ".experts." in name}
    names = {id(m): name for name, m in model.named_modules()}
    prefetch = {names[id(m)]: [names[id(s._modules[0])] for s in m._get_fsdp_state()._states_to_forward_prefetch]
                for m in model.modules() if isinstance(m, FSDPModule)}
    return placements, prefetch


@pytest.mark.slow
@pytest.mark.parametrize("num_experts, fsdp_placement", [(2, "S(1)"), (4, "_S(0, 2)")])  # _S: dim 0 within EP's shard
def test_experts_shard_along_dim_1_where_ranks_outnumber_them(num_experts, fsdp_placement):
    """EP 2 on 4 ranks: each expert is FSDP-sharded over 2 ranks (efsdp). One local expert (2 in all):
    dim 1; two local experts: dim 0, as before."""
    placements, prefetch = run_distributed(_experts_units, 4, num_experts, timeout=300)[0]
    # (efsdp's FSDP placement, then EP's Shard(0) over experts.)
    assert placements["layers.1.feed_forward.experts.w1"] == [fsdp_placement, "S(0)"]
    assert placements["layers.3.feed_forward.experts.w2"] == [fsdp_placement, "S(0)"]
    # Each unit starts the next block's all-gather and that of its experts (a unit of their own).
    assert prefetch["tok_embeddings"] == ["layers.0"]
    assert prefetch["layers.0"] == ["layers.1", "layers.1.feed_forward.experts"]
    assert prefetch["layers.2"] == ["layers.3", "layers.3.feed_forward.experts"]
    assert prefetch["layers.3"] == ["norm"]

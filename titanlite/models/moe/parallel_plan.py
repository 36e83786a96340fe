"""The MoE family's parallel plan: Llama's units and attention plans (the blocks differ only in the
feed-forward), plus the routed experts that expert parallel shards and the MoE layers whose load
balance the trainer updates.

Under tensor parallel (with sequence parallel) each tp rank routes the tokens of its own sequence
shard, as a data rank would: the layer takes its input as the local shard, and FSDP shards its
router and shared experts over `moe_fsdp`, which includes tp, so their gradients are summed over
the tp ranks' tokens too. The routed experts are whole on each rank (expert_tensor_parallel_degree
= 1; expert parallel then borrows the tp ranks) or split over tp along their hidden dim
(expert_tensor_parallel_degree = tp; parallel/expert.py).

torch.compile takes a MoE block whole, as a dense one, where its MoE layer traces as one graph:
its routed experts on the rank, as one grouped GEMM. Otherwise it takes the block's attention, the
router and the shared experts, and the rest of the MoE layer runs eagerly: expert parallel's
dispatch and combine read their split sizes to the host (a full graph cannot hold that read), as
the loop over experts reads each expert's count, and counts summed over ranks for the aux loss are
kept for recompute outside any graph.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import PrepareModuleInput

from titanlite.models.moe import hf
from titanlite.models.llama3 import parallel_plan as llama3_plan
from titanlite.models.family import ParallelPlan
from titanlite.models.common.moe import MoE, experts, moe_layers
from titanlite.models.moe.model import MoETransformer


def compile_units(block: nn.Module, tp_enabled: bool) -> list[nn.Module]:
    """Llama's units, unless the block's MoE layer cannot be one graph (`MoE.traces_whole`) or runs
    under TP: then its attention, router and shared experts."""
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    moe = inner.feed_forward if isinstance(inner.feed_forward, MoE) else None
    if moe is None or (moe.traces_whole() and not tp_enabled):
        return llama3_plan.compile_units(block, tp_enabled)
    return [inner.attention, moe.router] + ([moe.shared_experts] if moe.shared_experts is not None else [])


def block_plan(block: nn.Module, sequence_parallel: bool, float8_recipe: str | None) -> dict:
    """Llama's plan for a dense block; for a MoE block Llama's attention half, and the MoE layer
    takes this rank's sequence shard as a plain tensor (check_moe requires sequence parallel)."""
    if not isinstance(block.feed_forward, MoE):
        return llama3_plan.PLAN.block_tp_plan(block, sequence_parallel, float8_recipe)
    gathered = llama3_plan.float8_gathered_inputs(block, float8_recipe)
    return llama3_plan.attention_plan(sequence_parallel, gathered, llama3_plan.fused_attention(block), llama3_plan.head_norms(block)) | {
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)
    }


PLAN = ParallelPlan(
    build=MoETransformer,
    head=llama3_plan.PLAN.head,
    blocks=llama3_plan.PLAN.blocks,
    tail=llama3_plan.PLAN.tail,
    tp_plan=llama3_plan.PLAN.tp_plan,
    block_tp_plan=block_plan,
    compile_units=compile_units,
    hf=hf,  # Qwen3-MoE shapes, as Qwen3MoeForCausalLM
    experts=experts,
    moe_layers=moe_layers,
    expert_hidden_dims={"w1": 1, "w3": 1, "w2": 2},  # (experts, hidden, dim) and (experts, dim, hidden)
    float8_excluded=("router.gate",),  # float8 scores would move which experts tokens go to (TorchTitan keeps it too)
    qk_clip_rows=llama3_plan.PLAN.qk_clip_rows,  # the same attention (flavors with q/k norms are refused)
)

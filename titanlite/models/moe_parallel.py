"""The MoE family's parallel plan: Llama's units and attention plans (the blocks differ only in the
feed-forward), plus the routed experts that expert parallel shards and the MoE layers whose load
balance the trainer updates.

torch.compile takes a block's attention and a dense block's feed-forward; a MoE feed-forward runs
eagerly, since its routing has data-dependent sizes (expert parallel's split sizes, the loop over
experts) that a full graph cannot hold.
"""

from __future__ import annotations

from torch import nn

from titanlite import hf
from titanlite.models import llama_parallel
from titanlite.models.family import ParallelPlan
from titanlite.models.moe import MoE, MoETransformer, experts, moe_layers


def compile_units(block: nn.Module, tp_enabled: bool) -> list[nn.Module]:
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    return [inner.attention] + ([] if isinstance(inner.feed_forward, MoE) else [inner.feed_forward])


PLAN = ParallelPlan(
    build=MoETransformer,
    head=llama_parallel.PLAN.head,
    blocks=llama_parallel.PLAN.blocks,
    tail=llama_parallel.PLAN.tail,
    tp_plan=llama_parallel.PLAN.tp_plan,
    block_tp_plan=llama_parallel.PLAN.block_tp_plan,  # never reached: check_moe refuses tensor parallel
    compile_units=compile_units,
    cp_buffers=llama_parallel.cp_buffers,
    hf=hf,  # Qwen3-MoE shapes, as Qwen3MoeForCausalLM
    experts=experts,
    moe_layers=moe_layers,
)

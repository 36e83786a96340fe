"""DeepSeek-V3's parallel plan: the MoE family's units, experts and feed-forward plans, with latent
attention's tensor-parallel plan.

TP splits MLA by heads: the up projections wq (or wq_b) and wkv_b column-wise, wo row-wise. The down
projections wq_a and wkv_a and their latent norms are small and run whole on every tp rank, on the
gathered input (under sequence parallel; attention takes it as a plain tensor); the RoPE key part
they give, shared by all heads, passes `shared_key`, whose gradient is summed over the tp ranks.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from titanlite.models.common.moe import MoE
from titanlite.models.deepseek_v3 import hf
from titanlite.models.deepseek_v3.model import DeepSeekV3Transformer
from titanlite.models.family import ParallelPlan
from titanlite.models.llama3 import parallel_plan as llama3_plan
from titanlite.models.moe import parallel_plan as moe_plan
from titanlite.parallel.tensor import SharedByHeads


def attention_plan(block: nn.Module, sequence_parallel: bool) -> dict:
    query = "attention.wq_b" if hasattr(block.attention, "wq_b") else "attention.wq"
    plan = {
        query: ColwiseParallel(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.shared_key": SharedByHeads(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate()),
    }
    if sequence_parallel:
        plan |= {
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            # Gathered, as a plain tensor: the down projections run whole on it.
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None), use_local_output=True
            ),
        }
    return plan


def block_plan(block: nn.Module, sequence_parallel: bool, float8_recipe: str | None) -> dict:
    """MLA's plan, and the feed-forward's: Llama's dense SwiGLU, or the MoE layer on this rank's
    sequence shard (the MoE family's)."""
    if isinstance(block.feed_forward, MoE):
        ffn = {"feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)}
    else:
        gathered = llama3_plan.float8_gathered_inputs(block, float8_recipe)
        ffn = llama3_plan.feed_forward_plan(sequence_parallel, gathered)
    return attention_plan(block, sequence_parallel) | ffn


def model_plan(model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """Llama's plan of the embedding, final norm and output, and each multi-token prediction module:
    its block as the model's, and under sequence parallel its norms and joining projection on the
    sequence shard (token-wise: weights replicated, their gradients summed over tp)."""
    plan = llama3_plan.model_plan(model, sequence_parallel, loss_parallel)
    for k, module in (model.mtp or {}).items():
        if sequence_parallel:
            plan |= {f"mtp.{k}.{name}": SequenceParallel() for name in ("enorm", "hnorm", "norm")}
            plan[f"mtp.{k}.eh_proj"] = SequenceParallel(use_local_output=True)  # the block takes a plain shard
        plan |= {f"mtp.{k}.block.{name}": style for name, style in block_plan(module.block, sequence_parallel, None).items()}
    return plan


PLAN = ParallelPlan(
    build=DeepSeekV3Transformer,
    head=llama3_plan.PLAN.head,
    blocks=llama3_plan.PLAN.blocks,
    tail=(*llama3_plan.PLAN.tail, "mtp"),  # multi-token prediction runs after the output head, on the last stage
    tp_plan=model_plan,
    block_tp_plan=block_plan,
    compile_units=moe_plan.compile_units,
    hf=hf,
    experts=moe_plan.PLAN.experts,
    moe_layers=moe_plan.PLAN.moe_layers,
    expert_hidden_dims=moe_plan.PLAN.expert_hidden_dims,
    float8_excluded=moe_plan.PLAN.float8_excluded,  # the router (DeepSeek-V3 trained the rest of its GEMMs in float8)
    tail_on_one_stage=True,
    blocks_elsewhere=lambda model: [(module, "block") for module in (model.mtp or {}).values()],
    matrix_components=lambda a: {
        "attention.wkv_a.weight": (1, [a.kv_lora_rank, a.qk_rope_head_dim]),  # the latent, the shared rotary key
        "attention.wkv_b.weight": (a.n_heads, [a.qk_nope_head_dim, a.v_head_dim]),  # each head's keys, values
        "attention.wq.weight": (a.n_heads, [a.qk_nope_head_dim, a.qk_rope_head_dim]),  # each head's plain, rotary query
        "attention.wq_b.weight": (a.n_heads, [a.qk_nope_head_dim, a.qk_rope_head_dim]),
    },
    # Kimi K2's rule: each head's plain query and key rows by sqrt(gamma), its rotary query rows by gamma;
    # the shared rotary key (wkv_a) and the value rows stay
    qk_clip_rows=lambda a: (a.n_heads, {
        name: (a.n_heads, [(a.qk_nope_head_dim, 0.5), (a.qk_rope_head_dim, 1.0)]) for name in ("wq.weight", "wq_b.weight")
    } | {"wkv_b.weight": (a.n_heads, [(a.qk_nope_head_dim, 0.5), (a.v_head_dim, 0.0)])}),
)

"""gpt-oss's parallel plan: the MoE family's (models/moe/parallel_plan.py; every block a MoE block),
each attention's sinks split by heads under tensor parallel as q's heads are, and the experts'
biases sharded over experts with their weights. The q/k/v biases follow their weights' rows
(ColwiseParallel); wo's bias is added once, after the row-wise reduction (RowwiseParallel).
QK-clip has no rule for biased queries and keys (refused)."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from titanlite.models.gpt_oss import hf
from titanlite.models.gpt_oss.model import GptOssTransformer
from titanlite.models.moe import parallel_plan as moe_plan
from titanlite.parallel.tensor import ShardedHeads


def block_plan(block: nn.Module, sequence_parallel: bool, float8_recipe: str | None) -> dict:
    return moe_plan.block_plan(block, sequence_parallel, float8_recipe) | {"attention.sinks": ShardedHeads()}


PLAN = replace(
    moe_plan.PLAN,
    build=GptOssTransformer,
    block_tp_plan=block_plan,
    hf=hf,
    # Expert TP is refused (args.py); expert parallel shards every expert parameter over experts.
    expert_hidden_dims={"w1": 1, "w3": 1, "w2": 2},
    qk_clip_rows=None,
)

"""Llama 3's parallel plan (titanlite/models/family.py's ParallelPlan): the tensor-parallel plans as
plain dicts of stock ParallelStyles, its FSDP / pipeline / AC / compile units, and its Hugging Face
adapter.

TP: q/k/v and w1/w3 column-wise, wo and w2 row-wise; where q/k/v run as one matmul (FusedLinear), it
takes each rank's rows of all three. With sequence parallel, activations between blocks are sharded
along the sequence (Shard(1)): norms run on their shard, and each attention/FFN all-gathers its input
and reduce-scatters its output. With loss parallel, the logits stay sharded over the vocabulary
(Shard(-1)); the chunked loss takes each rank's rows of the output weight (loss.py).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from titanlite.models.llama3 import hf
from titanlite.float8 import Float8Linear, Float8PrepareModuleInput
from titanlite.models.family import ParallelPlan
from titanlite.models.llama3.model import Transformer
from titanlite.parallel.tensor import FusedColwiseParallel, OutputColwiseParallel

# The projections that read each sub-module's gathered input.
INPUT_PROJECTIONS = {"attention": ("wq", "wk", "wv"), "feed_forward": ("w1", "w3")}


def attention_plan(sequence_parallel: bool, float8_inputs: frozenset[str] = frozenset(), fused: bool = False,
                   qk_norm: bool = False) -> dict:
    """The TP plan of a block's attention half: q/k/v column-wise (and their `fused` matmul), wo
    row-wise; under sequence parallel its norm on the sequence shard and the shard gathered before
    the projections (in float8 when "attention" is in `float8_inputs`). The q/k head norms (Qwen3)
    see each rank's heads (dim 2): their weights' gradients are partial sums over tp, reduced."""
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate()),
    } | ({"attention.qkv": FusedColwiseParallel()} if fused else {})
    if qk_norm:
        plan |= {f"attention.{norm}": SequenceParallel(sequence_dim=2, use_local_output=True) for norm in ("q_norm", "k_norm")}
    if sequence_parallel:
        plan |= {
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            # The sequence shard is gathered before the projections; RoPE rows and the mask pass untouched.
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),
        }
    return plan | _float8_gathers(float8_inputs & {"attention"}, sequence_parallel)


def feed_forward_plan(sequence_parallel: bool, float8_inputs: frozenset[str] = frozenset()) -> dict:
    """The TP plan of a dense SwiGLU: w1/w3 column-wise, w2 row-wise (its input gathered under SP)."""
    plan = {
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate()),
    }
    if sequence_parallel:
        plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan | _float8_gathers(float8_inputs & {"feed_forward"}, sequence_parallel)


def _float8_gathers(names: set[str], sequence_parallel: bool) -> dict:
    """Sequence parallel's gathers before these sub-modules move float8 bytes."""
    return {name: Float8PrepareModuleInput() for name in names} if sequence_parallel else {}


def block_plan(block: nn.Module, sequence_parallel: bool, float8_recipe: str | None) -> dict:
    """The TP plan of one TransformerBlock."""
    float8_inputs = float8_gathered_inputs(block, float8_recipe)
    return attention_plan(sequence_parallel, float8_inputs, fused_attention(block), head_norms(block)) | feed_forward_plan(sequence_parallel, float8_inputs)


def fused_attention(block: nn.Module) -> bool:
    return block.attention.qkv is not None


def head_norms(block: nn.Module) -> bool:
    return block.attention.q_norm is not None


def float8_gathered_inputs(block: nn.Module, float8_recipe: str | None) -> frozenset[str]:
    """Sub-modules whose input can be gathered in float8: every projection reading it is a tensorwise
    float8 linear (a filtered or ineligible one needs the high-precision input)."""
    if float8_recipe != "tensorwise":
        return frozenset()
    return frozenset(
        name for name, projections in INPUT_PROJECTIONS.items()
        if all(isinstance(getattr(getattr(block, name), p, None), Float8Linear) for p in projections)
    )


def model_plan(model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """The plan of the embedding, final norm and output (those present: a pipeline stage may lack them)."""
    between_blocks = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between_blocks),
        "norm": SequenceParallel() if sequence_parallel else None,
        "output": OutputColwiseParallel(
            input_layouts=between_blocks,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,  # loss parallel needs the DTensor logits
        ),
    }
    return {name: style for name, style in plan.items() if style is not None and getattr(model, name) is not None}


def compile_units(block: nn.Module, tp_enabled: bool) -> list[nn.Module]:
    """A block; under TP its attention and feed_forward (parallel/compile.py says why)."""
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    return [inner.attention, inner.feed_forward] if tp_enabled else [block]


PLAN = ParallelPlan(
    build=Transformer,
    head=("tok_embeddings",),
    blocks="layers",
    tail=("norm", "output"),
    tp_plan=model_plan,
    block_tp_plan=block_plan,
    compile_units=compile_units,
    hf=hf,
    # Each query head's rows and each key head's, by sqrt(gamma): GQA's per key/value group
    qk_clip_rows=lambda a: (a.n_kv_heads, {"wq.weight": (a.n_heads, [(a.head_dim, 0.5)]),
                                          "wk.weight": (a.n_kv_heads, [(a.head_dim, 0.5)])}),
)

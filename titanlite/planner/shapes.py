"""What the cost model reads from a model's shapes: the parameters of a pipeline stage, the tensors a
block keeps for backward, its attention's dimensions (grouped-query, or DeepSeek-V3's multi-head
latent attention) and how far its queries see (Llama 4's chunks), the work multi-token prediction
adds after the output head, and how many nodes a routed token's copies reach.

Blocks may differ: a MoE model's dense blocks (DeepSeek's first ones, Llama 4's interleaved ones:
the args' is_moe) keep a dense SwiGLU, so MoE costs are counted for the MoE blocks only, and a
pipeline stage's weights for the blocks it holds.

Multi-head latent attention (MLA, DeepSeek-V3): each head's query and key are qk_nope + qk_rope wide
(192 in V3), its value v_head_dim (128). Queries come through a q_lora_rank latent, keys and values
through one kv_lora_rank latent; those down projections and their norms run whole on every tp rank
(titanlite and Megatron split MLA by heads only), so their FLOPs repeat on each of the tp ranks.
titanlite pads the values to the query/key head dim before the attention kernel (one head dim for
every kernel: SDPA's flash, the context-parallel rings, flex), so its AV product costs as if
v_head_dim were 192 and its attention keeps 192-wide values and outputs; Transformer Engine's
attention (Megatron, NeMo AutoModel) takes the values' own head dim.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from math import comb

from titanlite.models.common.args import ModelArgs, MoEArgs
from titanlite.models.deepseek_v3.args import DeepSeekV3Args
from titanlite.models.llama4.args import Llama4Args


@dataclass(frozen=True)
class AttentionShape:
    """One block's attention as the kernels see it, on one GPU's tp shard of the heads."""

    q_heads: int
    kv_heads: int
    qk_head_dim: int  # QK^T's inner dim
    v_head_dim: int  # the values' head dim in the kernel (MLA padded: the query/key head dim)
    latents: int  # MLA's per-token latents, whole on every tp rank (queries' and keys'/values'); 0 for GQA

    @property
    def q_width(self) -> int:
        return self.q_heads * self.qk_head_dim

    @property
    def k_width(self) -> int:
        return self.kv_heads * self.qk_head_dim

    @property
    def v_width(self) -> int:
        return self.kv_heads * self.v_head_dim


def attention_shape(model: ModelArgs, values_padded: bool = True) -> AttentionShape:
    """`values_padded`: MLA's values padded to the query/key head dim (titanlite's kernels)."""
    if isinstance(model, DeepSeekV3Args):
        v = model.qk_head_dim if values_padded else model.v_head_dim
        return AttentionShape(model.n_heads, model.n_heads, model.qk_head_dim, v, model.q_lora_rank + model.kv_lora_rank)
    return AttentionShape(model.n_heads, model.n_kv_heads, model.head_dim, model.head_dim, 0)


def mtp_depth(model: ModelArgs) -> int:
    return model.mtp_depth if isinstance(model, DeepSeekV3Args) else 0


@lru_cache(maxsize=256)
def flops_per_token(model: ModelArgs, seq_len: int) -> float:
    """model.flops_per_token, counted block by block once per shape (the planner prices thousands of
    layouts of one shape)."""
    return model.flops_per_token(seq_len)


@lru_cache(maxsize=256)
def attention_flops(model: ModelArgs, seq_len: int) -> float:
    """Core attention's FLOPs per token as flops_per_token counts them (the full square: QK^T over the
    query/key head dim, AV over the values' own), multi-token prediction's blocks included."""
    return model.attention_flops_per_token(seq_len) * (model.n_layers + mtp_depth(model)) / model.n_layers


def padded_attention_flops(model: ModelArgs, seq_len: int, shape: AttentionShape) -> float:
    """The same, as the kernel computes it: AV over the kernel's value head dim (MLA padded: 192, not 128)."""
    counted = attention_flops(model, seq_len)
    if not isinstance(model, DeepSeekV3Args):
        return counted
    return counted * (model.qk_head_dim + shape.v_head_dim) / (model.qk_head_dim + model.v_head_dim)


@lru_cache(maxsize=256)
def attention_spans(model: ModelArgs, seq_len: int) -> tuple[tuple[int, bool, int], ...]:
    """(the most keys a query sees, whether the attention runs masked, blocks) for each kind of block:
    masked, it runs FlexAttention's block mask, and under context parallel titanlite's document ring.
    Llama 4's RoPE blocks see their chunk of attention_chunk_size positions, masked; its NoPE blocks,
    as every other model's, the sequence, masked only under document masks. Their keys weigh as
    attention_flops_per_token counts them."""
    documents = model.attn_mask_type == "block_causal"
    if not isinstance(model, Llama4Args):
        return ((seq_len, documents, model.n_layers),)
    chunk = min(seq_len, model.attention_chunk_size)
    kinds = Counter((chunk, True) if model.uses_rope(i) else (seq_len, documents) for i in range(model.n_layers))
    return tuple((keys, masked, blocks) for (keys, masked), blocks in kinds.items())


def is_moe_block(model: ModelArgs, layer: int) -> bool:
    return isinstance(model, MoEArgs) and model.is_moe(layer)


@lru_cache(maxsize=256)
def heaviest_layers(model: ModelArgs, count: int) -> range:
    """The `count` consecutive blocks with the most MoE blocks among them (the first such): the
    largest pipeline stage, or the two blocks FSDP holds gathered at once."""
    count = min(count, model.n_layers)
    start = max(range(model.n_layers - count + 1), key=lambda s: moe_blocks_among(model, range(s, s + count)))
    return range(start, start + count)


@lru_cache(maxsize=1024)
def moe_blocks_among(model: ModelArgs, layers: range) -> int:
    return sum(is_moe_block(model, i) for i in layers)


@lru_cache(maxsize=256)
def moe_layers(model: ModelArgs) -> int:
    """MoE blocks, multi-token prediction's (a MoE block each) included."""
    return model.moe_layer_count if isinstance(model, MoEArgs) else 0


def moe_share(model: ModelArgs) -> float:
    """The MoE blocks' share of all blocks (multi-token prediction's included)."""
    return moe_layers(model) / (model.n_layers + mtp_depth(model))


def expert_params(model: ModelArgs) -> float:
    """Routed-expert weights of one MoE block (0 for a dense model)."""
    return 3 * model.dim * model.moe_hidden_dim * model.num_experts if isinstance(model, MoEArgs) else 0.0


def routed_flops(model: ModelArgs) -> float:
    """Per token: the FLOPs of the top_k routed experts it visits in every MoE block."""
    if not isinstance(model, MoEArgs):
        return 0.0
    return 6 * model.top_k * expert_params(model) / model.num_experts * moe_layers(model)


def tail_flops(model: ModelArgs, seq_len: int) -> float:
    """Per token: what the last pipeline stage runs after the blocks: the output projection, and each
    multi-token prediction depth's module (joining projection, one MoE block with its attention) and
    its own pass through the output head."""
    depth = mtp_depth(model)
    output = 6 * model.vocab_size * model.dim * (1 + depth)
    if not depth:
        return output
    return output + 6 * model.mtp_params(active=True) + model.attention_flops_per_token(seq_len) * depth / model.n_layers


def latent_down_params(model: ModelArgs) -> int:
    """MLA's down projections (queries' and keys'/values' latents), run whole on every tp rank."""
    if not isinstance(model, DeepSeekV3Args):
        return 0
    return model.dim * (model.q_lora_rank + model.kv_lora_rank + model.qk_rope_head_dim)


@lru_cache(maxsize=256)
def block_weights(model: ModelArgs, layers: range) -> tuple[float, float]:
    """The weights of these blocks: (all but the routed experts', the routed experts')."""
    total = sum(model.attention_params + model.feed_forward_params(i) for i in layers)
    experts = moe_blocks_among(model, layers) * expert_params(model)
    return total - experts, experts


@lru_cache(maxsize=256)
def stage_params(model: ModelArgs, pp: int) -> float:
    """Parameters of the largest pipeline stage: its blocks plus the embedding or the output (and the
    multi-token prediction modules, which sit on the last stage with the output)."""
    mtp = model.mtp_params() if mtp_depth(model) else 0
    if pp == 1:
        return model.num_params() + mtp
    blocks = sum(block_weights(model, heaviest_layers(model, -(-model.n_layers // pp))))
    return blocks + model.vocab_size * model.dim + model.dim + mtp


def stage_expert_params(model: ModelArgs, pp: int) -> float:
    """The routed experts' weights in the largest pipeline stage (multi-token prediction's MoE blocks
    with them)."""
    if pp == 1:
        return moe_layers(model) * expert_params(model)
    return block_weights(model, heaviest_layers(model, -(-model.n_layers // pp)))[1] + mtp_depth(model) * expert_params(model)


def block_activation_elements(model: ModelArgs, tokens: float, layout, values_padded: bool = True, moe: bool = True) -> float:
    """Elements autograd saves in one block for `tokens` local tokens (sequence parallel under TP): a
    MoE block's where the model has them and `moe`, else a dense block's."""
    d, tp = model.dim, layout.tp
    a = attention_shape(model, values_padded)
    f = model.ffn_hidden_dim
    gathered = d / tp if layout.sp_regather else d  # a norm output as its GEMMs save it
    if layout.ac == "full":
        return tokens * d / tp  # the block input only
    if isinstance(model, MoEArgs) and moe:
        # Each tp rank routes tokens / tp tokens: k copies of the input, each expert's w1/w3 outputs,
        # silu(w1) and w2's input, its output; the shared experts' SwiGLU; the router's scores.
        routed = model.top_k * (2 * d + 4 * model.moe_hidden_dim)
        ffn = (routed + 4 * model.num_shared_experts * model.moe_hidden_dim + model.num_experts) / tp
        ffn_op = (model.top_k * (2 * d + 2 * model.moe_hidden_dim) + 2 * model.num_shared_experts * model.moe_hidden_dim) / tp
    else:
        ffn = gathered + 4 * f / tp  # the norm output: w1/w3's input; w1 and w3 outputs, silu(w1), w2's input
        ffn_op = gathered + 2 * f / tp
    if a.latents:
        # MLA: the down projections' input (gathered: they run whole), each latent and its norm output,
        # then per head q, k and v as the kernel takes them, its output and log-sum-exp (fp32: 2), and
        # wo's input (the output cut back to v_head_dim). The op policy keeps the matmul outputs: the
        # latents, the up projections' (q; keys' and values' parts) and the attention output.
        values = model.n_heads * model.v_head_dim
        attention = gathered + 2 * a.latents + (a.q_width + a.k_width + 2 * a.v_width + 2 * a.q_heads + values) / tp
        up = a.q_width + model.n_heads * (model.qk_nope_head_dim + model.v_head_dim)
        attention_op = gathered + a.latents + (up + a.v_width) / tp
    else:
        attention = gathered + (3 * a.q_width + 2 * a.k_width) / tp  # the norm output; q, k, v, attention output, wo's input
        attention_op = gathered + (2 * a.q_width + 2 * a.k_width) / tp
    if layout.ac in ("op", "op_half"):  # matmul and attention outputs (TorchTitan's policy: half the matmuls'; counted as all)
        return tokens * (d / tp + attention_op + ffn_op)
    return tokens * (2 * d / tp + attention + ffn)  # the two norms' inputs (sequence-sharded) first


def elementwise_elements(model: ModelArgs, layout, values_padded: bool = True) -> float:
    """Activations per token a block's memory-bound work reads and writes, on average over the blocks:
    the two norm outputs, q and the attention output, k and v, SwiGLU's three (MLA: and its latents
    and their norms; in MoE blocks: the routed copies, permuted out and combined back)."""
    a = attention_shape(model, values_padded)
    tp = layout.tp
    elements = (2 * model.dim + 2 * a.q_width + a.k_width + a.v_width + 3 * model.ffn_hidden_dim) / tp + 2 * a.latents
    if isinstance(model, MoEArgs):
        elements += moe_share(model) * 2 * model.top_k * model.dim / tp
    return elements


def remote_nodes_per_token(model: ModelArgs, ep: int, nvlink_domain: int) -> float:
    """Nodes (NVLink domains) other than its own that one token's routed copies reach, for a
    dispatcher that sends a token once to each node it needs (DeepEP, HybridEP; then NVLink inside):
    uniformly spread experts, over ep ranks laid out domain by domain. Group-limited routing
    (DeepSeek-V3) picks topk_group of n_group expert groups per token; with the groups laid out by
    node (n_group a multiple of the nodes), a token reaches only the nodes of its groups, at most
    topk_group."""
    nodes = -(-ep // nvlink_domain)
    if nodes <= 1 or not isinstance(model, MoEArgs):
        return 0.0
    if model.n_group > 1 and model.n_group % nodes == 0:
        per_node = model.n_group // nodes  # groups on each node
        untouched = comb(model.n_group - per_node, model.topk_group) / comb(model.n_group, model.topk_group)
        return (nodes - 1) * (1 - untouched)
    return (nodes - 1) * (1 - (1 - 1 / nodes) ** model.top_k)

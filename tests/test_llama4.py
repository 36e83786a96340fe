"""Llama 4: published sizes, which blocks are MoE and NoPE (against transformers' config), the chunked
mask against one built by hand, the routing weight before the expert, and context parallel's ring
skipping the KV shards outside a query's chunk (counted). Hugging Face logits: test_llama4_hf.py;
every parallel layout against 1 process: test_parallel_parity.py's l4_* cases."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from titanlite.models import FAMILIES, build_model, model_args

FLAVORS = FAMILIES["llama4"].flavors


def vision_parameters() -> int:
    """Meta's Llama 4 vision encoder and projector (their config.json: 34 layers of width 1408), which
    the published totals include and titanlite's text model has not."""
    from transformers import Llama4Config, Llama4VisionConfig
    from transformers.models.llama4.modeling_llama4 import Llama4MultiModalProjector, Llama4VisionModel

    vision = Llama4VisionConfig(
        hidden_size=1408, intermediate_size=5632, num_hidden_layers=34, num_attention_heads=16, vision_output_dim=4096,
        projector_input_dim=4096, projector_output_dim=4096, image_size=336, patch_size=14, pixel_shuffle_ratio=0.5,
    )
    config = Llama4Config(vision_config=vision.to_dict())
    with torch.device("meta"):
        modules = [Llama4VisionModel(config.vision_config), Llama4MultiModalProjector(config)]
    return sum(p.numel() for m in modules for p in m.parameters())


def text_parameters_by_hand(experts: int, moe_blocks: int) -> tuple[int, int]:
    """(total, active) of Meta's text model, from its config.json: 48 blocks of width 5120, 40 query
    and 8 kv heads of 128, experts and the shared expert 8192 wide, dense SwiGLU 16384, vocab 202048."""
    dim, vocab = 5120, 202048
    attention = 2 * dim * 40 * 128 + 2 * dim * 8 * 128 + 2 * dim  # + the two block norms
    expert = 3 * dim * 8192
    moe = dim * experts + (experts + 1) * expert
    dense = 3 * dim * 16384
    outer = 2 * vocab * dim + dim
    total = outer + 48 * attention + moe_blocks * moe + (48 - moe_blocks) * dense
    active = total - moe_blocks * (experts - 1) * expert
    return total, active


def test_scout_and_maverick_have_their_published_sizes():
    """Scout 109B total (Meta's card; 108.6B on the Hub), Maverick 400B (402B on the Hub), both 17B
    active: text model by hand, plus the vision encoder titanlite does not build."""
    vision = vision_parameters()
    for flavor, experts, moe_blocks, published in (("17bx16e", 16, 48, 109), ("17bx128e", 128, 24, 400)):
        args = FLAVORS[flavor]
        total, active = text_parameters_by_hand(experts, moe_blocks)
        assert args.num_params() == total and args.num_params(active=True) == active, flavor
        assert round((total + vision) / 1e9, -1 if published == 400 else 0) == published, (flavor, total + vision)
        assert round(active / 1e9) == 17, (flavor, active)
    assert round((FLAVORS["17bx16e"].num_params() + vision) / 1e8) == 1086  # the Hub's 108,641,793,536


@pytest.mark.parametrize("flavor", ["debugmodel", "17bx16e", "17bx128e"])
def test_moe_and_nope_blocks_are_where_transformers_puts_them(flavor):
    from transformers import Llama4TextConfig

    args = FLAVORS[flavor].with_vocab(256)
    config = Llama4TextConfig(num_hidden_layers=args.n_layers, interleave_moe_layer_step=args.interleave_moe_layer_step)
    assert [i for i in range(args.n_layers) if args.is_moe(i)] == config.moe_layers
    assert [int(args.uses_rope(i)) for i in range(args.n_layers)] == config.no_rope_layers
    model = build_model("llama4", args)
    for i, block in model.layers.items():
        assert block.attention.use_rope == args.uses_rope(int(i))
        assert hasattr(block.feed_forward, "router") == args.is_moe(int(i))


def allowed_by_hand(chunk: int, document_ids: list[list[int]], positions: list[list[int]]) -> torch.Tensor:
    """(b, s, s): key j is visible to query i when both are in one document and one chunk of positions
    and j is not later than i."""
    rows = []
    for ids, pos in zip(document_ids, positions):
        s = len(ids)
        rows.append([[ids[i] == ids[j] and pos[i] // chunk == pos[j] // chunk and j <= i for j in range(s)] for i in range(s)])
    return torch.tensor(rows)


def test_chunked_mask_is_the_chunks_within_documents():
    """The RoPE blocks' mask: causal within chunks of 4 positions, from the window's start, or with
    positions restarting at each document, from each document's; the NoPE blocks' mask: documents only."""
    from titanlite.models.common.attention import document_layout

    args = replace(model_args("llama4", "debugmodel", 64, 24), attention_chunk_size=4, n_layers=4)
    model = FAMILIES["llama4"].plan.build(args)
    tokens = torch.randint(2, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    tokens[0, [5, 6, 17]] = 1
    tokens[1, [0, 10]] = 1
    for reset in (False, True):
        ids, positions = document_layout(tokens, 1, reset)
        _, inputs = model.position_inputs(positions, ids, 24)
        chunked = inputs.chunked.allowed(inputs.chunked.document_ids, inputs.chunked.positions)[:, 0]
        assert torch.equal(chunked, allowed_by_hand(4, ids.tolist(), positions.tolist())), reset
        full = inputs.full.allowed(ids, positions)[:, 0]
        assert torch.equal(full, allowed_by_hand(10**6, ids.tolist(), positions.tolist())), reset
    _, inputs = model.position_inputs(None, None, 24)  # causal: chunks of the window, no document mask
    assert inputs.full is None
    window = [list(range(24))]
    assert torch.equal(inputs.chunked.allowed(inputs.chunked.document_ids, inputs.chunked.positions)[:, 0],
                       allowed_by_hand(4, [[0] * 24], window))


def test_chunked_mask_on_flex_attention_matches_sdpa(monkeypatch):
    """The chunked mask's FlexAttention block mask (built once per forward) computes what SDPA's
    boolean mask does, with documents and chunks crossing. On CPU: forward only, uncompiled."""
    from torch.nn.attention import flex_attention

    from titanlite.models.common import attention
    from titanlite.models.common.attention import CoreAttention, document_layout

    for name in ("flex_attention", "create_block_mask"):
        monkeypatch.setitem(attention._COMPILED, name, getattr(flex_attention, name))
    tokens = torch.randint(2, 64, (2, 128), generator=torch.Generator().manual_seed(1))
    tokens[:, [20, 70, 100]] = 1
    ids, positions = document_layout(tokens, 1, reset_positions=False)
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 8, 128, 16, generator=gen), torch.randn(2, 2, 128, 16, generator=gen), torch.randn(2, 2, 128, 16, generator=gen)
    outputs = []
    for attn_type in ("sdpa", "flex"):
        args = replace(model_args("llama4", "debugmodel", 64, 128), attention_chunk_size=48, n_layers=4, attn_type=attn_type)
        _, inputs = FAMILIES["llama4"].plan.build(args).position_inputs(positions, ids, 128)
        assert (inputs.chunked.block_mask is not None) == (attn_type == "flex")
        outputs.append(CoreAttention()(q, k, v, inputs.chunked))
    assert (outputs[0] - outputs[1]).abs().max() < 1e-5


def test_routing_weight_scales_the_token_before_its_expert():
    """Llama 4's order: expert(w * x), not w * expert(x) (a SwiGLU is not linear, so they differ)."""
    from titanlite.models.common.moe import MoE

    args = replace(FLAVORS["debugmodel"], dim=16, moe_hidden_dim=32, num_experts=4)
    torch.manual_seed(0)
    layer = MoE(args)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(1, 6, 16)
    flat = x.view(6, 16)
    weight, expert = layer.router.gate(flat).max(dim=-1)
    w1, w2, w3 = layer.experts.w1, layer.experts.w2, layer.experts.w3

    def swiglu(e, rows):
        return (F.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T

    shared = layer.shared_experts(flat)
    before = torch.stack([swiglu(e, torch.sigmoid(w) * row) for w, e, row in zip(weight, expert, flat)]) + shared
    after = torch.stack([torch.sigmoid(w) * swiglu(e, row) for w, e, row in zip(weight, expert, flat)]) + shared
    out = layer(x).view(6, 16)
    assert (out - before).abs().max() < 1e-5
    assert (out - after).abs().max() > 1e-3


SEQ, CHUNK, CP = 256, 64, 4


def ring_rounds(rotate_method: str, load_balance: bool) -> dict:
    """This rank's shard (head-tail pieces, or one contiguous quarter) of chunked attention over 256
    tokens in chunks of 64 through the ring, forward and backward, against masked SDPA over the whole
    sequence; and the rounds the ring ran and skipped."""
    import torch.distributed as dist

    from titanlite.models.common.attention import DocumentMask
    from titanlite.parallel import document_ring
    from titanlite.parallel.context import RingAttention

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, SEQ, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, SEQ, 8, generator=gen, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(1, 4, SEQ, 8, generator=gen)
    window = torch.arange(SEQ)
    visible = (window[:, None] // CHUNK == window[None, :] // CHUNK) & (window[None, :] <= window[:, None])
    full = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=visible)
    full.backward(grad_out)

    piece = SEQ // (2 * CP)
    mine = (torch.cat([window[rank * piece:(rank + 1) * piece], window[(2 * CP - 1 - rank) * piece:(2 * CP - rank) * piece]])
            if load_balance else window[rank * SEQ // CP:(rank + 1) * SEQ // CP])
    positions = mine[None]
    shard = [t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    for key in document_ring.ROUNDS:
        document_ring.ROUNDS[key] = 0
    out = RingAttention(dist.group.WORLD, rotate_method)(*shard, DocumentMask(positions // CHUNK, positions))
    out.backward(grad_out[:, :, mine])
    pairs = [(out, full[:, :, mine])] + [(s.grad, t.grad[:, :, mine]) for s, t in zip(shard, (q, k, v))]
    worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)
    return {"worst": worst, **{f"{d}_{o}": n for (d, o), n in document_ring.ROUNDS.items()}}


def ring_cases() -> dict:
    return {(method, balance): ring_rounds(method, balance) for method in ("allgather", "alltoall") for balance in (True, False)}


@pytest.mark.slow
def test_ring_skips_kv_shards_outside_the_queries_chunks():
    """CP 4, chunks of 64 over 256 tokens. Head-tail balanced, rank r holds pieces r and 7-r of 32
    tokens: ranks 0 and 1 hold chunks {0, 3}, ranks 2 and 3 chunks {1, 2}, so each rank runs its own
    shard and its partner's and skips the other two, forward and backward. Contiguous quarters are one
    chunk each: every rank runs only its own. Exact against masked SDPA either way, for both rotations."""
    for rank, cases in enumerate(run_distributed(ring_cases, CP)):
        for (method, balance), result in cases.items():
            where = f"rank {rank} {method} load_balance={balance}"
            assert result["worst"] < 1e-5, (where, result)
            run, skipped = (2, 2) if balance else (1, 3)
            for direction in ("forward", "backward"):
                assert (result[f"{direction}_run"], result[f"{direction}_skipped"]) == (run, skipped), (where, result)

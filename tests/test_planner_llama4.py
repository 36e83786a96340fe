"""The planner on Llama 4: chunked attention (its FLOPs and time fall with the chunk, except under
titanlite's context parallel, whose document ring computes every score), interleaved MoE (Maverick's
24 MoE blocks of 48 priced as such, top-1 routing moving each token once), the experts' states as
titanlite's FSDP shards them, and the layouts it recommends for Maverick (docs/planner.md's table)."""

import os
import re
import sys
from dataclasses import replace

import pytest

from helpers import REPO, run_command
from titanlite.hardware import find_gpu
from titanlite.models import model_args
from titanlite.models.llama4.args import LLAMA4_FLAVORS
from titanlite.planner import Layout, estimate, explain, plan
from titanlite.planner.shapes import (
    attention_flops, attention_spans, moe_layers, routed_flops, stage_expert_params, stage_params,
)

MAVERICK, SCOUT = LLAMA4_FLAVORS["17bx128e"], LLAMA4_FLAVORS["17bx16e"]
DOCS = REPO / "docs" / "planner.md"


def test_chunked_attention_flops_and_time_fall_with_the_chunk():
    """36 of Maverick's 48 blocks (RoPE) attend within chunks of 8192, 12 (NoPE) over the sequence:
    12 x heads x head_dim x (36 min(seq, chunk) + 12 seq) FLOPs a token. At 128K tokens a shorter
    chunk is a shorter step. Under CP it saves nothing: titanlite's document ring sends every KV
    shard to every rank and computes every score, whatever the chunk."""
    for seq in (4096, 8192, 131072):
        direct = 12 * 40 * 128 * (36 * min(seq, 8192) + 12 * seq)
        assert attention_flops(MAVERICK, seq) == direct
        assert sum(12 * 40 * 128 * keys * blocks for keys, _, blocks in attention_spans(MAVERICK, seq)) == direct
    h100 = find_gpu("H100")
    layout = Layout(dp_shard=32, tp=8, ep=64, ac="full", float8=True, compile=True, tp_overlap=True)
    chunks = (131072, 32768, 8192, 2048)
    estimates = [estimate(replace(MAVERICK, attention_chunk_size=c), 131072, 64, h100, layout) for c in chunks]
    compute = [e.time["compute"] for e in estimates]
    assert compute == sorted(compute, reverse=True) and len(set(compute)) == len(chunks), compute
    assert estimates[2].step_time < 0.6 * estimates[0].step_time  # 8192 against none: attention is most of 128K's work
    with_cp = [estimate(replace(MAVERICK, attention_chunk_size=c), 131072, 64, h100, replace(layout, dp_shard=16, cp=2))
               for c in (8192, 2048)]
    assert with_cp[0].time["compute"] == pytest.approx(with_cp[1].time["compute"])
    assert with_cp[0].step_time > 5 * estimates[2].step_time  # fp32 scores of every key: far slower than no CP


def test_interleaved_moe_is_priced_for_its_moe_blocks_only():
    """Maverick has a MoE block every second block: 24 of 48 hold 128 experts (top-1), the others a
    dense SwiGLU. Its routed FLOPs, all-to-all and a pipeline stage's experts are 24 MoE blocks'
    worth, not 48; Scout (MoE in every block) has 48."""
    assert moe_layers(MAVERICK) == 24 and moe_layers(SCOUT) == 48
    expert = 3 * 5120 * 8192  # one routed expert's w1, w2, w3
    assert routed_flops(MAVERICK) == 6 * 1 * expert * 24  # one expert a token in each MoE block
    # Inside one node (EP 8, NVLink): each token's hidden state once out and once back per MoE block,
    # forward and backward, 7 of 8 copies to another GPU.
    h100 = find_gpu("H100")
    e = estimate(MAVERICK, 8192, 8, h100, Layout(dp_shard=8, ep=8))
    tokens = 8192  # one sequence a GPU
    assert e.time["ep all-to-all"] == pytest.approx(4 * 24 * tokens * 5120 * 2 * 1 * 7 / 8 / h100.nvlink_bandwidth)
    # A pipeline stage of 12 blocks holds 6 MoE blocks' experts and 6 dense SwiGLUs.
    moe_ffn, dense_ffn = MAVERICK.feed_forward_params(1), MAVERICK.feed_forward_params(0)
    assert moe_ffn > 10 * dense_ffn
    assert stage_expert_params(MAVERICK, 4) == 6 * 128 * expert
    embedding = MAVERICK.vocab_size * MAVERICK.dim + MAVERICK.dim
    assert stage_params(MAVERICK, 4) == 12 * MAVERICK.attention_params + 6 * moe_ffn + 6 * dense_ffn + embedding
    # Without PP, FSDP holds two consecutive blocks gathered, a MoE one (its rank's 16 of 128 experts
    # at EP 8) and a dense one: bf16 weights and fp32 gradients.
    e = estimate(MAVERICK, 8192, 64, h100, Layout(dp_shard=64, ep=8))
    dense_weights = 2 * MAVERICK.attention_params + moe_ffn - 128 * expert + dense_ffn
    assert e.memory["gathered"] == pytest.approx((dense_weights + 16 * expert) * (2 + 4))


def test_expert_states_as_titanlites_fsdp_shards_them():
    """The debug model's 8 experts at EP 8 over dp_shard 16 leave each EP rank one expert a MoE block,
    shared by two efsdp ranks: FSDP shards it along dim 1 (along dim 0 the first rank would hold it
    whole): the planner's states against what titanlite's dry run puts on rank 0."""
    env = {**os.environ, "NGPU": "16", "COMM_MODE": "fake_backend", "PYTHON": sys.executable,
           "CONFIG_FILE": "train_configs/debug_moe.toml"}
    out = run_command(["./run_train.sh", "--model.name", "llama4", "--model.flavor", "debugmodel", "--model.hf_assets_path", "byte",
                       "--training.seq_len", "256", "--training.local_batch_size", "1", "--validation.enable", "false",
                       "--parallelism.data_parallel_shard_degree", "16", "--parallelism.expert_parallel_degree", "8"], cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    on_rank_0 = int(re.search(r"([\d,]+) on rank 0", out.stdout).group(1).replace(",", ""))
    args = model_args("llama4", "debugmodel", 259, 256)  # the byte tokenizer's vocab
    states = estimate(args, 256, 16, find_gpu("H100"), Layout(dp_shard=16, ep=8)).memory["states"]
    assert states / 16 == pytest.approx(on_rank_0, rel=1e-3)  # FSDP pads the dense weights a little
    assert on_rank_0 < 1.01 * args.num_params() / 16  # an even share (dim 0 put 1.5x on rank 0)


@pytest.mark.parametrize("gpu", ["H100", "GB200"])
def test_recommends_a_layout_for_maverick_that_fits_and_explains_it(gpu):
    """256 GPUs, seq 8192, 1024 sequences a step: the best layout fits, spreads the experts (EP 64 or
    more: top-1 routing makes the all-to-all cheap), uses no CP (the document ring), and is the one
    docs/planner.md recommends; the explanation names what each alternative loses. (Float8 layouts
    only, half the search: float8 wins by about 20% on both.)"""
    fitting, rejected = plan(MAVERICK, 8192, 1024, find_gpu(gpu), 256, float8=True)
    best = fitting[0]
    lines = explain(fitting, rejected, MAVERICK, 8192)
    print("\n".join(lines))
    assert best.fits and best.memory_total <= best.capacity
    assert best.layout.ep >= 64 and best.layout.cp == 1, best.layout.describe()
    assert lines[0].startswith(f"best: {best.layout.describe()}:") and "ep all-to-all" in lines[1]
    alternatives = [line for line in lines if line.startswith("  vs ")]
    assert any(line.startswith("  vs pp ") for line in alternatives) and any(line.startswith("  vs ep ") for line in alternatives)
    vs_cp = next(line for line in alternatives if line.startswith("  vs cp 2 "))
    assert "compute +" in vs_cp, vs_cp
    row = next(line for line in DOCS.read_text().splitlines() if line.startswith(f"| Maverick | 256 {gpu} |"))
    assert f"`{best.layout.describe()}`" in row and f"{best.tokens_per_second_per_gpu:,.0f}" in row, row

"""gpt-oss: the published sizes, logits equal to transformers' GptOssForCausalLM through the Hugging
Face import (sinks, windows, biases, YaRN, clamped experts) and back through the export, MXFP4
dequantized as transformers does, and sliding windows under context parallel exact while only the
window's keys travel. Parity on the layouts: tests/parity_cases.py (gpt_oss_*)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

from helpers import random_hf_model
from titanlite.models import build_model, model_args

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")


# OpenAI's model card: total parameters, and active ones per token (the output projection in, the
# input embedding out).
@pytest.mark.parametrize("flavor, total, active", [("120b", 116.8, 5.1), ("20b", 20.9, 3.6)])
def test_flavors_have_the_published_sizes(flavor, total, active):
    args = model_args("gpt_oss", flavor, 0, 4096)
    model = build_model("gpt_oss", args)  # on the meta device: a fake-backend dry run counts these
    counted = sum(p.numel() for p in model.parameters())
    assert counted == args.num_params()
    assert round(counted / 1e9, 1) == total
    assert round(args.num_params(exclude_embedding=True, active=True) / 1e9, 1) == active


def tiny_config(window: int = 8) -> "transformers.GptOssConfig":
    return transformers.GptOssConfig(
        vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=window,
        max_position_embeddings=131072, initializer_range=0.1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 4096},
    )


def our_args(window: int = 8):
    return replace(
        model_args("gpt_oss", "debugmodel", 320, 256), dim=64, moe_hidden_dim=64, n_layers=3, n_heads=4, n_kv_heads=2,
        head_dim_override=32, num_experts=4, top_k=2, sliding_window=window,
    )


def reference_model() -> "transformers.GptOssForCausalLM":
    """Random, with biases, sinks and router biases away from zero, and experts large enough that
    the clamp at 7 bites."""
    reference = random_hf_model(transformers.GptOssForCausalLM, tiny_config())
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0.0, 1.0)
            elif "experts" in name:
                p.normal_(0.0, 1.5)
    return reference


def test_transformers_logits_through_the_import_and_back_through_the_export(tmp_path):
    """A random GptOssForCausalLM (windows of 8 over 40 tokens, sinks, biases, YaRN over 4,096, clamps
    at work) imports with its logits (fp32, 1e-4), fused q/k/v or not; our export loads in transformers
    with the same logits."""
    from titanlite.errors import ConfigError
    from titanlite.models.gpt_oss.hf import check_hf_shapes, save_hf
    from titanlite.models.gpt_oss.model import GptOssTransformer
    from titanlite.models.hf import load_hf

    reference = reference_model()
    reference.save_pretrained(str(tmp_path / "hf"))
    imported = load_hf(tmp_path / "hf")
    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        for fused in (False, True):  # q/k/v as three linears, or one matmul with their biases
            ours = GptOssTransformer(replace(our_args(), fused_projections=fused)).eval()
            ours.load_state_dict(imported)
            torch.testing.assert_close(ours(tokens), expected, rtol=1e-4, atol=1e-4)

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    check_hf_shapes(config, our_args(), tmp_path / "hf")  # transformers' config.json fits the model
    with pytest.raises(ConfigError, match="has sliding_window=8, the model being trained 16"):
        check_hf_shapes(config, our_args(window=16), tmp_path / "hf")

    state = ours.state_dict()
    save_hf(lambda names: {n: state[n] for n in names}, {n: w.numel() for n, w in state.items()}, our_args(),
            tmp_path / "out", torch.float32)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["sliding_window"], config["layer_types"][:2]) == (
        "gpt_oss", 8, ["sliding_attention", "full_attention"])
    back = transformers.GptOssForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, expected, rtol=1e-4, atol=1e-4)


def test_mxfp4_experts_dequantize_as_transformers_does():
    """Random MXFP4 blocks and exponents: ours against transformers' own dequantization (which it
    then transposes to its (experts, in, out) layout)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from titanlite.models.gpt_oss.hf import dequantize_mxfp4

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 10, 2), generator=gen, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(dequantize_mxfp4(blocks, scales), theirs.transpose(1, 2))


def softmax_with_a_sink_column(q, k, v, sinks, allowed):
    """transformers' eager gpt-oss attention: the sink as one more logit column, dropped after the softmax."""
    repeats = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(repeats, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, -torch.inf)
    column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    return torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1] @ v.repeat_interleave(repeats, 1)


@pytest.mark.parametrize("masked", [True, False], ids=["window", "causal"])
def test_sink_attention_equals_the_softmax_with_a_sink_column(masked):
    """CPU's kernel with the sinks (GQA, a window of 4 or causal), forward and every gradient, the sinks' included."""
    from titanlite.models.common.attention import sink_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 12, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 12, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    rows = torch.arange(12)
    allowed = (rows[:, None] >= rows) & ((rows[:, None] - rows < 4) if masked else True)
    out = sink_attention(q, k, v, allowed.expand(2, 1, 12, 12) if masked else None, sinks)
    expected = softmax_with_a_sink_column(q, k, v, sinks, allowed)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    for ours, theirs in zip((out, *torch.autograd.grad(out, (q, k, v, sinks), grad)),
                            (expected, *torch.autograd.grad(expected, (q, k, v, sinks), grad))):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def windows_under_cp(window: int, load_balance: bool, documents: bool, compiled: bool = False) -> tuple[float, int, bool]:
    """This cp rank's chunks (head-tail, or contiguous) of q, k, v through RingAttention with a
    window and sinks (`compiled`: in one graph, as compiled blocks hold it), against one process's
    CoreAttention over the whole sequence: (the worst relative difference of the output and the q,
    k, v and sink gradients, tail tokens received, whether the document ring ran)."""
    import torch.distributed as dist

    from titanlite.models.common.attention import CoreAttention, DocumentMask
    from titanlite.parallel import document_ring, window_halo
    from titanlite.parallel.context import RingAttention

    rank, n = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    seq = 8 * n
    q = torch.randn(2, 4, seq, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 2, seq, 8, generator=gen, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, generator=gen, requires_grad=True)
    grad = torch.randn(2, 4, seq, 8, generator=gen)
    ids = (torch.rand(2, seq, generator=gen) < (0.15 if documents else 0)).cumsum(1)
    positions = torch.arange(seq).expand(2, seq)
    full = CoreAttention()(q, k, v, DocumentMask(ids, positions, window=window), sinks)
    full.backward(grad)

    chunks = torch.arange(seq).view((2 if load_balance else 1) * n, -1)
    mine = torch.cat([chunks[rank], chunks[2 * n - 1 - rank]]) if load_balance else chunks[rank]
    shard = [t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    local_sinks = sinks.detach().clone().requires_grad_()
    received, rounds = window_halo.TAIL_TOKENS_RECEIVED[0], dict(document_ring.ROUNDS)
    ring = RingAttention(dist.group.WORLD, "alltoall", load_balance)
    if compiled:
        ring = torch.compile(ring, fullgraph=True, backend="aot_eager")
    out = ring(*shard, DocumentMask(ids[:, mine], positions[:, mine], window=window), local_sinks)
    out.backward(grad[:, :, mine])
    dist.all_reduce(local_sinks.grad)  # each rank's queries' share
    pairs = [(out, full[:, :, mine]), (local_sinks.grad, sinks.grad)] + [
        (s.grad, t.grad[:, :, mine]) for s, t in zip(shard, (q, k, v))]
    worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)
    return worst, window_halo.TAIL_TOKENS_RECEIVED[0] - received, document_ring.ROUNDS != rounds


def window_cases() -> dict:
    cases = {(5, lb, docs): windows_under_cp(5, lb, docs) for lb in (True, False) for docs in (False, True)}
    cases[(9, True, True)] = windows_under_cp(9, True, True)  # chunks of 4 < 8 tail tokens: the document ring
    cases[(4, True, True)] = windows_under_cp(4, True, True, compiled=True)
    return cases


@pytest.mark.parametrize("ranks", [2, 3])
def test_windows_and_sinks_under_context_parallel_match_one_process(ranks):
    """The window crossing chunk boundaries, with and without documents, head-tail and contiguous
    chunks: exact (1e-5), and only window - 1 tokens per boundary between ranks travel (none where one
    rank holds both chunks: head-tail's middle); a window longer than a chunk runs the full ring."""
    from distributed import run_distributed

    results = run_distributed(window_cases, ranks)
    for (window, load_balance, documents), _ in results[0].items():
        per_rank = [r[(window, load_balance, documents)] for r in results]
        assert max(worst for worst, _, _ in per_rank) < 1e-5, (window, load_balance, documents, per_rank)
        if window == 9:
            assert all(ring for _, _, ring in per_rank) and sum(tokens for _, tokens, _ in per_rank) == 0
            continue
        boundaries = (2 if load_balance else 1) * ranks - 1 - (1 if load_balance else 0)  # between two ranks
        assert sum(tokens for _, tokens, _ in per_rank) == boundaries * (window - 1)
        assert not any(ring for _, _, ring in per_rank)


def test_muon_takes_the_expert_weights_and_adamw_their_biases_and_the_sinks():
    """gpt-oss's expert biases are 2-d (one vector per expert): AdamW's, as every bias and the sinks."""
    from titanlite.config import parse_args
    from titanlite.optim.build import build_optimizer

    config = parse_args(["--model.name", "gpt_oss", "--model.flavor", "debugmodel", "--optimizer.name", "Muon"])
    with torch.device("meta"):
        model = build_model("gpt_oss", model_args("gpt_oss", "debugmodel", 259, 64, None, config.model))
    optimizer = build_optimizer(model.named_parameters(), config)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    experts = "layers.0.feed_forward.experts"
    assert {f"{experts}.w1", f"{experts}.w2", "layers.0.attention.wq.weight"} <= muon
    assert not {n for n in muon if n.endswith("bias") or "sinks" in n}
    assert f"{experts}.w1_bias" in names.values()


@pytest.mark.parametrize("flags, words", [
    (["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "2"],
     "parallelism.expert_tensor_parallel_degree=2: gpt-oss's experts have output biases"),
    (["--model.flavor_overrides", "sliding_window=0"], "sliding_window=0 must be >= 1"),
    (["--model.converters", "quantize.grouped_mm.float8", "--quantize.grouped_mm.float8.fqns", "experts"],
     "gpt-oss's experts (biases, the clamped SwiGLU) do not run on float8 grouped GEMMs"),
])
def test_what_gpt_oss_cannot_take_is_one_line(flags, words, corpus_jsonl, tmp_path):
    from titanlite import preflight
    from titanlite.config import parse_args
    from titanlite.errors import ConfigError

    from helpers import tiny_args

    with pytest.raises(ConfigError, match=re.escape(words)) as error:
        config = parse_args(tiny_args(corpus_jsonl, tmp_path, "--model.name", "gpt_oss", "--model.flavor", "debugmodel", *flags))
        preflight.check(config, 2)
    assert "\n" not in str(error.value)


def test_qk_clip_is_refused_in_one_line():
    """gpt-oss's queries and keys carry biases: no rule scales their logits (the trainer builds the clip with the optimizer)."""
    from titanlite.config import parse_args
    from titanlite.errors import ConfigError
    from titanlite.models import FAMILIES
    from titanlite.optim.qk_clip import qk_clip

    config = parse_args(["--model.name", "gpt_oss", "--optimizer.name", "Muon", "--optimizer.qk_clip_threshold", "100"])
    model = build_model("gpt_oss", model_args("gpt_oss", "debugmodel", 259, 64))
    with pytest.raises(ConfigError, match="optimizer.qk_clip_threshold=100.0 with model gpt_oss flavor debugmodel: the family has no QK-clip rule"):
        qk_clip(config, model, FAMILIES["gpt_oss"].plan, None)


def test_a_checkpoint_with_mxfp4_experts_imports_with_transformers_logits(tmp_path):
    """The released layout: each expert weight as MXFP4 `_blocks` and `_scales` (experts, out, in / 32,
    ...). Random ones, dequantized by transformers into its model; its saved files then get the packed
    pair in place of each weight, and our import reads those."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from titanlite.models.gpt_oss.model import GptOssTransformer
    from titanlite.models.hf import load_hf

    reference = reference_model()
    gen = torch.Generator().manual_seed(2)
    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(reference.model.layers):
            for name in ("gate_up_proj", "down_proj"):
                weight = getattr(layer.mlp.experts, name)  # (experts, in, out)
                experts, inputs, outputs = weight.shape
                blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=gen, dtype=torch.uint8)
                scales = torch.randint(122, 128, (experts, outputs, inputs // 32), generator=gen, dtype=torch.uint8)
                weight.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packed |= {f"model.layers.{i}.mlp.experts.{name}_blocks": blocks, f"model.layers.{i}.mlp.experts.{name}_scales": scales}
    reference.save_pretrained(str(tmp_path))
    file = next(tmp_path.glob("*.safetensors"))
    tensors = {k: v for k, v in load_file(str(file)).items() if not k.endswith(("gate_up_proj", "down_proj"))}
    save_file(tensors | packed, str(file), metadata={"format": "pt"})

    ours = GptOssTransformer(our_args()).eval()
    ours.load_state_dict(load_hf(tmp_path))
    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), reference(tokens).logits, rtol=1e-4, atol=1e-4)


def test_flexattention_with_sinks_matches_the_softmax_with_a_sink_column(monkeypatch):
    """The GPU path, forward, on CPU (uncompiled): the step's window block mask, and one read from a
    dense mask (context parallel's window keys), through flex's log-sum-exp."""
    from torch.nn.attention import flex_attention

    from titanlite.models.common import attention

    for name in ("flex_attention", "create_block_mask"):
        monkeypatch.setitem(attention._COMPILED, name, getattr(flex_attention, name))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 128, 16, generator=gen)
    k, v = (torch.randn(2, 2, 128, 16, generator=gen) for _ in range(2))
    sinks = torch.randn(4, generator=gen)
    ids = (torch.rand(2, 128, generator=gen) < 0.05).cumsum(1)
    positions = torch.arange(128).expand(2, 128)
    mask = attention.build_mask(ids, positions, "flex", window=20)
    allowed = mask.allowed(ids, positions)
    expected = softmax_with_a_sink_column(q, k, v, sinks, allowed)
    for block_mask in (mask.block_mask, attention.dense_block_mask(allowed)):
        out = attention.flex_sink_attention(q, k, v, block_mask, sinks)
        assert (out - expected).abs().max() < 1e-5


@pytest.mark.parametrize("change, words", [
    ({"load_balance_coeff": 1e-3}, "an expert bias (model.moe_load_balance_coeff)"),
    ({"route_norm": False}, "unnormalized top-k weights"),
    ({"attention_bias": False}, "attention without biases"),
])
def test_what_transformers_would_compute_otherwise_is_not_exported(change, words):
    """Checked before training (checkpoint.last_save_in_hf), in one line."""
    from titanlite.errors import ConfigError
    from titanlite.models import FAMILIES

    FAMILIES["gpt_oss"].check_hf_export(our_args())
    with pytest.raises(ConfigError, match=re.escape(words)):
        FAMILIES["gpt_oss"].check_hf_export(replace(our_args(), **change))


@pytest.mark.parametrize("flavor, total, layout", [
    ("120b", 116.8, ["NGPU=8", "NNODES=8", "--parallelism.expert_parallel_degree", "64"]),
    ("20b", 20.9, ["NGPU=8", "NNODES=1", "--parallelism.expert_parallel_degree", "8"]),
])
def test_a_fake_backend_dry_run_reports_the_published_size(flavor, total, layout):
    """run_train.sh as a user would check a layout before renting GPUs (COMM_MODE=fake_backend)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHON=sys.executable, COMM_MODE="fake_backend", CONFIG_FILE="train_configs/debug_gpt_oss.toml", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", **dict(word.split("=") for word in layout if "=" in word))
    flags = [word for word in layout if "=" not in word]
    result = subprocess.run(["./run_train.sh", "--model.flavor", flavor, "--training.seq_len", "4096", *flags],
                            cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "dry run OK" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]
    params = int(re.search(r"model ([\d,]+) params", result.stdout).group(1).replace(",", ""))
    assert round(params / 1e9, 1) == total

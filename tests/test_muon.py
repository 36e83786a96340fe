"""Muon: torch.optim.Muon's update bit for bit, one matrix per expert, AdamW beside it for what Muon
should not take, checkpoints, bad input. Every layout against one process: test_parallel_parity.py's
muon_* cases."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import launch, tiny_args


def muon(params, **change):
    from titanlite.optim.muon import Muon

    settings = dict(momentum=0.95, nesterov=True, ns_steps=5, ns_dtype="bfloat16", adjust_lr_fn="original",
                    adamw=dict(lr=0.02, weight_decay=0.1))
    settings.update(change)
    return Muon([{"params": params, "lr": 0.02, "weight_decay": 0.1}], [], **settings)


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48), (7, 130)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("adjust_lr_fn, nesterov, dtype", [
    ("original", True, torch.float32), ("match_rms_adamw", True, torch.float32), ("original", False, torch.float32),
    # bf16 weights too, Nesterov on (off, torch's bf16 copy of the buffer is the buffer, which its
    # Newton-Schulz then normalizes in place: titanlite leaves the momentum alone).
    ("original", True, torch.bfloat16),
], ids=["original", "match_rms_adamw", "no_nesterov", "bf16"])
def test_each_matrix_takes_torch_muons_update_bit_for_bit(shape, adjust_lr_fn, nesterov, dtype):
    """Wide, tall and square matrices, both lr adjustments, with and without Nesterov: 3 steps of
    titanlite's Muon and torch.optim.Muon from the same weights and gradients give the same bits."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(shape, generator=gen).to(dtype)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    mine = muon([ours], adjust_lr_fn=adjust_lr_fn, nesterov=nesterov)
    torch_muon = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    for _ in range(3):
        grad = torch.randn(shape, generator=gen).to(dtype)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        mine.step()
        torch_muon.step()
    assert not torch.equal(ours, start) and torch.equal(ours, theirs)
    assert torch.equal(mine.state[ours]["momentum_buffer"], torch_muon.state[theirs]["momentum_buffer"])


def test_auto_runs_newton_schulz_in_fp32_on_cpu_and_as_torch_on_a_gpu():
    """ns_dtype auto (the default): fp32 on CPU (bf16 there, without bf16 instructions, is ~30x slower),
    bf16 on a GPU as torch.optim.Muon; an update in fp32 is not the bf16 one."""
    from titanlite.config import parse_args
    from titanlite.optim.muon import newton_schulz_dtype

    assert parse_args([]).optimizer.ns_dtype == "auto"
    assert newton_schulz_dtype("auto", torch.device("cpu")) is torch.float32
    assert newton_schulz_dtype("auto", torch.device("cuda", 0)) is torch.bfloat16
    assert newton_schulz_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    gen = torch.Generator().manual_seed(2)
    start, grad = torch.randn(32, 48, generator=gen), torch.randn(32, 48, generator=gen)
    steps = {}
    for ns_dtype in ("auto", "float32", "bfloat16"):
        weight = torch.nn.Parameter(start.clone())
        weight.grad = grad.clone()
        muon([weight], ns_dtype=ns_dtype).step()
        steps[ns_dtype] = weight.detach()
    assert torch.equal(steps["auto"], steps["float32"]) and not torch.equal(steps["auto"], steps["bfloat16"])


def test_a_grouped_expert_weight_is_one_matrix_per_expert():
    """(experts, rows, cols): each expert's update is torch.optim.Muon's on that expert alone."""
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(4, 24, 40, generator=gen)
    experts = torch.nn.Parameter(start.clone())
    singles = [torch.nn.Parameter(start[e].clone()) for e in range(4)]
    mine, theirs = muon([experts]), torch.optim.Muon(singles, lr=0.02, weight_decay=0.1)
    for _ in range(2):
        grad = torch.randn(4, 24, 40, generator=gen)
        experts.grad = grad.clone()
        for e, p in enumerate(singles):
            p.grad = grad[e].clone()
        mine.step()
        theirs.step()
    assert all(torch.equal(experts[e], singles[e]) for e in range(4))


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    """Debug MoE model: the embedding, output, router gates, norms and biases go to AdamW (its own lr
    and weight decay); attention and expert weights to Muon. A pattern matching nothing is refused."""
    from titanlite.config import ConfigError, parse_args
    from titanlite.models import build_model, model_args
    from titanlite.optim.build import build_optimizer, check_adamw_params

    config = parse_args(["--model.name", "moe", "--model.flavor", "debugmoe", "--optimizer.name", "Muon",
                         "--optimizer.adamw_lr", "0.003", "--optimizer.adamw_weight_decay", "0.0"])
    args = model_args("moe", "debugmoe", 259, 64, None, config.model)
    with torch.device("meta"):
        model = build_model("moe", args)
    optimizer = build_optimizer(model.named_parameters(), config)
    names = {id(p): n for n, p in model.named_parameters()}
    by_kind = {kind: sorted(names[id(p)] for g in optimizer.param_groups if g["muon"] == kind for p in g["params"])
               for kind in (True, False)}
    assert "layers.0.attention.wq.weight" in by_kind[True] and "layers.1.feed_forward.experts.w1" in by_kind[True]
    adamw = by_kind[False]
    assert {"tok_embeddings.weight", "output.weight", "norm.weight", "layers.1.feed_forward.router.gate.weight"} <= set(adamw)
    assert all(".attention." not in n or n.endswith("norm.weight") for n in adamw), adamw
    assert {(g["lr"], g["weight_decay"]) for g in optimizer.param_groups if not g["muon"]} == {(0.003, 0.0)}
    assert {(g["lr"], g["weight_decay"]) for g in optimizer.param_groups if g["muon"]} == {(config.optimizer.lr, 0.1)}
    check_adamw_params(config, [model], torch.device("cpu"))  # the defaults pass on any family
    config.optimizer.adamw_params = ["tok_embeddings", "no_such_module"]
    with pytest.raises(ConfigError, match=r"\['no_such_module'\] match no part of any parameter's name"):
        check_adamw_params(config, [model], torch.device("cpu"))


@pytest.mark.parametrize("flag, value, words", [
    ("--training.enable_cpu_offload", "true", "optimizer.name='Muon' with training.enable_cpu_offload=true"),
    ("--optimizer.adamw_lr", "-1", "optimizer.adamw_lr=-1.0 must be >= 0"),
    ("--optimizer.momentum", "-0.9", "optimizer.momentum=-0.9 must be >= 0"),
    ("--optimizer.ns_steps", "0", "optimizer.ns_steps=0 must be between 1 and 99"),
    ("--optimizer.ns_steps", "100", "optimizer.ns_steps=100 must be between 1 and 99"),
])
def test_bad_muon_settings_are_one_line(flag, value, words):
    from titanlite.config import ConfigError, parse_args

    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        parse_args(["--optimizer.name", "Muon", flag, value])


def test_muon_resumes_bit_for_bit_and_a_changed_optimizer_is_one_line(corpus_jsonl, tmp_path):
    """4 steps straight against 2, a save, and 2 more: the same losses bit for bit (the momentum
    buffers restored); the save loaded on FSDP 2 gives the same losses. An AdamW checkpoint loaded by a Muon run stops in one line naming the change."""
    def train(folder, steps: int, *extra: str, nproc: int = 1, expect: int = 0):
        return launch(nproc, tiny_args(corpus_jsonl, folder, "--training.steps", str(steps), "--checkpoint.enable", "--checkpoint.interval",
                                       "2", "--lr_scheduler.decay_ratio", "0", "--training.data_split", "sequences", *extra), expect=expect)

    def losses(folder):
        return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]

    muon_args = ["--optimizer.name", "Muon", "--optimizer.lr", "0.02"]
    train(tmp_path / "straight", 4, *muon_args)
    train(tmp_path / "resumed", 2, *muon_args)
    assert "loaded checkpoint" in train(tmp_path / "resumed", 4, *muon_args).stdout
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert len(straight) == len(resumed) == 4 and straight == resumed and all(x == x for x in straight)
    # Resharded: step 2's checkpoint of one process (Muon's momentum, AdamW's moments) loaded by FSDP 2;
    # step 4's loss reads the momentum (without it, 0.14 off; with it, round-off: FSDP's gradients are a
    # few ulps off one process's, and Newton-Schulz carries that on).
    load = ["--checkpoint.initial_load_path", str(tmp_path / "straight" / "checkpoint" / "step-2"),
            "--checkpoint.initial_load_model_only", "false", "--training.local_batch_size", "1"]
    train(tmp_path / "fsdp2", 4, *muon_args, *load, nproc=2)
    resharded = losses(tmp_path / "fsdp2")
    assert len(resharded) == 2 and all(abs(a - b) < 1e-4 for a, b in zip(resharded, straight[2:])), (resharded, straight)
    train(tmp_path / "adamw", 2)
    changed = train(tmp_path / "adamw", 4, *muon_args, expect=2)
    assert "holds the optimizer state of AdamW or Adam, but optimizer.name='Muon' keeps 'momentum_buffer'" in changed.stderr
    back = train(tmp_path / "straight", 6, expect=2)  # Muon's checkpoint of step 4 read by AdamW
    assert "holds the optimizer state of AdamW or Adam and Muon, but optimizer.name='AdamW' keeps" in back.stderr, back.stderr[-2000:]


# Layouts on a (1, 2, 2) mesh: each parameter's placements, and the (mesh dim, tensor dim) cuts they
# make of the whole in the order they make them (FSDP's strided shard over TP or EP cuts last; a mesh
# dim of one rank cuts nothing). Uneven sizes and an empty piece too.
def spread_layouts():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    fsdp_over_tp = [Replicate(), _StridedShard(0, split_factor=2), Shard(0)]
    return [
        ((64, 32), [Replicate(), Shard(0), Replicate()], [(1, 0)]),  # FSDP
        ((16, 96), [Replicate(), Replicate(), Shard(1)], [(2, 1)]),  # TP rowwise
        ((33, 40), [Shard(1), Shard(0), Shard(1)], [(1, 0), (2, 1)]),  # FSDP x TP rowwise, a dim of one rank
        ((48, 48), fsdp_over_tp, [(2, 0), (1, 0)]),  # FSDP x TP colwise
        ((33, 40), fsdp_over_tp, [(2, 0), (1, 0)]),
        ((3, 20, 24), fsdp_over_tp, [(2, 0), (1, 0)]),  # EP x FSDP: 3 experts, one rank's piece empty
    ]


def cut(whole: torch.Tensor, cuts, coordinate) -> torch.Tensor:
    """This coordinate's piece: torch.chunk along each cut in turn (chunk's pieces, an empty one at the end)."""
    from titanlite.optim.owners import piece_sizes

    for mesh_dim, dim in cuts:
        sizes = piece_sizes(whole.shape[dim], [1, 2, 2][mesh_dim])
        whole = whole.narrow(dim, sum(sizes[:coordinate[mesh_dim]]), sizes[coordinate[mesh_dim]])
    return whole


def spread_on_ranks() -> dict:
    """On 4 gloo ranks: matrices cut along one or two mesh dims, orthogonalized by their owners, against
    the whole orthogonalized in one process and cut, and against every rank gathering every matrix."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from titanlite.optim.muon import orthogonalize
    from titanlite.optim.owners import orthogonal_pieces

    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("one", "a", "b"))
    me = mesh.get_coordinate()
    gen = torch.Generator().manual_seed(0)
    params, updates, expected = [], [], []
    calls = []

    def orthogonal(full):
        calls.append(tuple(full.shape))
        matrices = full if full.ndim == 3 else full.unsqueeze(0)
        return torch.stack([orthogonalize(m, 5, torch.float32) for m in matrices]).reshape(full.shape)

    for shape, placements, cuts in spread_layouts():
        whole = torch.randn(shape, generator=gen)
        p = DTensor.from_local(cut(whole, cuts, me), mesh, placements, shape=whole.shape, stride=whole.stride(), run_check=False)
        assert torch.equal(p.full_tensor(), whole), (shape, placements)  # the cuts are DTensor's own
        params.append(p)
        updates.append(p.to_local().clone())
        expected.append(cut(orthogonal(whole), cuts, me))
    calls.clear()
    spread = orthogonal_pieces(params, updates, [orthogonal] * len(params), owners=True, ns_dtype=torch.float32)
    mine = list(calls)
    everywhere = orthogonal_pieces(params, updates, [orthogonal] * len(params), owners=False, ns_dtype=torch.float32)
    return {"owners": [torch.equal(a, b) for a, b in zip(spread, expected)],
            "every_rank": [torch.equal(a, b) for a, b in zip(everywhere, expected)], "mine": mine}


def test_owners_orthogonalize_each_matrix_once_and_send_back_every_rank_gathering_its_pieces():
    from distributed import run_distributed

    results = run_distributed(spread_on_ranks, 4)
    assert all(all(r["owners"]) and all(r["every_rank"]) for r in results), results
    owned = [r["mine"] for r in results]
    # Once per group of ranks that share the matrix (a matrix cut along one mesh dim: once in each of 2)
    shapes = [shape for shape, _, cuts in spread_layouts() for _ in range(4 // 2 ** len(cuts))]
    assert sorted(sum(owned, [])) == sorted(shapes) and all(owned), owned


def test_a_weight_of_several_projections_is_orthogonalized_per_projection():
    """MLA's wkv_b holds each head's key rows then value rows: Muon's update is torch.optim.Muon's on
    the keys of all heads and on the values of all heads, as two matrices (each at its own shape's lr)."""
    heads, nope, v, cols = 4, 6, 10, 24
    gen = torch.Generator().manual_seed(2)
    start = torch.randn(heads * (nope + v), cols, generator=gen)
    fused = torch.nn.Parameter(start.clone())
    per_head = start.reshape(heads, nope + v, cols)
    keys = torch.nn.Parameter(per_head[:, :nope].reshape(-1, cols).clone())
    values = torch.nn.Parameter(per_head[:, nope:].reshape(-1, cols).clone())
    mine = muon([fused])
    mine.components = {fused: (heads, [nope, v])}
    theirs = torch.optim.Muon([keys, values], lr=0.02, weight_decay=0.1)
    for _ in range(2):
        grad = torch.randn(heads * (nope + v), cols, generator=gen).reshape(heads, nope + v, cols)
        fused.grad = grad.reshape(-1, cols).clone()
        keys.grad, values.grad = grad[:, :nope].reshape(-1, cols).clone(), grad[:, nope:].reshape(-1, cols).clone()
        mine.step()
        theirs.step()
    got = fused.detach().reshape(heads, nope + v, cols)
    # The lr scale multiplies the orthogonalized block before the lr, not the lr: a rounding apart.
    torch.testing.assert_close(got[:, :nope].reshape(-1, cols), keys.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(got[:, nope:].reshape(-1, cols), values.detach(), rtol=0, atol=1e-6)
    assert not torch.allclose(got.reshape(-1, cols), start)


def test_the_planner_counts_one_momentum_for_muons_matrices():
    """Llama 3 8B, FSDP 8: AdamW's states are 16 bytes per parameter; Muon's 12 for all but the
    embedding and output (AdamW's beside it, 16): a direct count."""
    from titanlite.hardware import find_gpu
    from titanlite.models.llama3.args import LLAMA3_FLAVORS
    from titanlite.planner import Layout, estimate

    model, gpu = LLAMA3_FLAVORS["8B"], find_gpu("H100")
    states = {muon: estimate(model, 8192, 16, gpu, Layout(dp_shard=8, ac="op", muon=muon)).memory["states"] for muon in (False, True)}
    params, embeddings = model.num_params(), 2 * model.vocab_size * model.dim
    assert states[False] == pytest.approx(16 * params / 8)
    assert states[True] == pytest.approx((12 * (params - embeddings) + 16 * embeddings) / 8)

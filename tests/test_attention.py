"""Document-masked (block_causal) attention: the layout of packed windows, packed documents against
each document alone, the FlexAttention path against SDPA, the positions and RoPE rows a Trainer
hands the model (model.reset_position_ids), the context-parallel document ring against plain
attention, and the run through the CLI. (Every parallel layout against the documents
alone: test_parallel_parity.py's doc_* cases.)"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from helpers import launch, tiny_args
from test_cli import metrics
from titanlite.launch import curve_difference
from titanlite.models import build_model, model_args
from titanlite.models.common.attention import CoreAttention, build_mask, document_layout

BOS = 1


def test_document_layout_starts_a_document_at_each_bos():
    tokens = torch.tensor([[5, BOS, 6, 7, BOS, 8], [BOS, 2, 3, 4, 5, 6]])
    ids, positions = document_layout(tokens, BOS, reset_positions=False)
    assert ids.tolist() == [[0, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 1]]
    assert positions.tolist() == [list(range(6))] * 2
    # Restarted positions: each document's BOS at 0; a window's leading tail of a document counts from 0 too.
    _, positions = document_layout(tokens, BOS, reset_positions=True)
    assert positions.tolist() == [[0, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5]]


def test_document_layout_with_one_token_for_bos_and_eos():
    """Documents joined by pairs of one separator E: the first ends a document, the second starts one."""
    E = 9
    tokens = torch.tensor([[5, E, E, 6, 7, E, E, 8]])
    ids, positions = document_layout(tokens, E, reset_positions=True, eos_id=E)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 1, 2, 2]]
    assert positions.tolist() == [[0, 1, 0, 1, 2, 3, 0, 1]]


def test_document_layout_of_token_files_that_end_documents_with_eos_alone():
    """Megatron's and OLMo's files: no BOS, EOS ends each document, and the token after it starts the
    next; with BOS and EOS both present (titanlite's own) the BOS after an EOS starts it once."""
    E = 2
    ids, positions = document_layout(torch.tensor([[5, E, 6, 7, E, 8]]), BOS, reset_positions=True, eos_id=E)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2]] and positions.tolist() == [[0, 1, 0, 1, 2, 0]]
    ids, _ = document_layout(torch.tensor([[5, E, BOS, 7, E, BOS]]), BOS, reset_positions=False, eos_id=E)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2]]
    # One token for BOS and EOS (GPT-2's, Qwen's): a lone one ends a document in those files too.
    ids, positions = document_layout(torch.tensor([[10, 11, 12, E, 14, 15, E, 17]]), E, reset_positions=True, eos_id=E)
    assert ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 2]] and positions.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]


def packed_windows(vocab: int, rows: int, seq_len: int, documents_per_row: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, vocab, (rows, seq_len + 1), generator=gen)
    return tokens.scatter_(1, torch.randint(1, seq_len, (rows, documents_per_row), generator=gen), BOS)


def small_model(attn_mask_type: str = "block_causal", flavor: str = "debugmodel_gqa"):
    args = replace(model_args("llama3", flavor, 512, 128), n_layers=2, attn_mask_type=attn_mask_type, attn_type="sdpa")
    model = build_model("llama3", args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    return model


@pytest.mark.parametrize("reset_positions", [False, True])
def test_packed_documents_give_the_losses_and_gradients_of_each_document_alone(reset_positions):
    """fp32, 1 process: every token's loss, and the gradient of the summed loss, equal those of its
    document run on its own (RoPE is relative, so restarting positions changes only round-off)."""
    model = small_model()
    tokens = packed_windows(512, 2, 128, 4)
    x, y = tokens[:, :-1], tokens[:, 1:]
    ids, positions = document_layout(x, BOS, reset_positions)
    packed = F.cross_entropy(model(x, positions, ids).flatten(0, 1), y.flatten(), reduction="none").view_as(y)
    packed.sum().backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    worst, documents = 0.0, 0
    for row in range(len(x)):
        for document in ids[row].unique():
            alone = ids[row] == document
            losses = F.cross_entropy(model(x[row, alone][None])[0], y[row, alone], reduction="none")
            losses.sum().backward()
            worst = max(worst, (losses - packed[row, alone]).abs().max().item())
            documents += 1
    assert documents >= 8 and worst < 1e-5, (documents, worst)
    for name, p in model.named_parameters():
        diff = ((p.grad - packed_grads[name]).abs().max() / p.grad.abs().max()).item()
        assert diff < 1e-5, (name, diff)
    # The mask matters: plain causal attention over the packed windows gives other losses.
    causal = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none").view_as(y)
    assert (causal - packed).abs().max() > 1e-2


def test_flex_attention_path_matches_sdpa(monkeypatch):
    """The FlexAttention path (block mask built once, GQA in the kernel) computes what the SDPA
    boolean mask does. On CPU FlexAttention runs forward only and uncompiled; the GPU benchmark
    script runs it compiled, with backward."""
    from torch.nn.attention import flex_attention

    from titanlite.models.common import attention

    for name in ("flex_attention", "create_block_mask"):
        monkeypatch.setitem(attention._COMPILED, name, getattr(flex_attention, name))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 128, 16, generator=gen)
    k, v = torch.randn(2, 2, 128, 16, generator=gen), torch.randn(2, 2, 128, 16, generator=gen)
    ids, positions = document_layout(packed_windows(512, 2, 127, 3), BOS, reset_positions=True)
    sdpa = CoreAttention()(q, k, v, build_mask(ids, positions, "sdpa"))
    flex_mask = build_mask(ids, positions, "flex")
    assert flex_mask.block_mask is not None
    flex = CoreAttention()(q, k, v, flex_mask)
    assert (flex - sdpa).abs().max() < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention trains on CUDA only")
def test_compiled_flex_attention_trains_like_sdpa_on_cuda():
    """On a GPU: the compiled FlexAttention path, forward and backward, against SDPA's boolean mask."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 1024, 64, device="cuda", generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 2, 1024, 64, device="cuda", generator=gen, requires_grad=True) for _ in range(2))
    ids, positions = document_layout(packed_windows(512, 2, 1023, 5).cuda(), BOS, reset_positions=False)
    results = []
    for attn_type in ("sdpa", "flex"):
        out = CoreAttention()(q, k, v, build_mask(ids, positions, attn_type))
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        results.append((out, *grads))
    for sdpa, flex in zip(*results):
        assert ((flex - sdpa).abs().max() / sdpa.abs().max()).item() < 1e-3


def ring_against_plain_attention(rotate_method: str, reset_positions: bool) -> float:
    """This cp rank's shard of q, k, v (rows of a random permutation of the sequence, as any load
    balancer might assign) through the document ring, against masked SDPA over the whole sequence:
    the worst relative difference of the output and of the q, k, v gradients."""
    import torch.distributed as dist

    from titanlite.parallel.context import RingAttention

    rank, n = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    seq = 8 * n
    q = torch.randn(2, 4, seq, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 2, seq, 8, generator=gen, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(2, 4, seq, 8, generator=gen)
    ids, positions = document_layout(packed_windows(512, 2, seq - 1, 3, seed=1)[:, :seq], BOS, reset_positions)
    full = CoreAttention()(q, k, v, build_mask(ids, positions, "sdpa"))
    full.backward(grad_out)

    mine = torch.randperm(seq, generator=gen).view(n, -1)[rank]
    shard = [t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    out = RingAttention(dist.group.WORLD, rotate_method)(*shard, build_mask(ids[:, mine], positions[:, mine], "sdpa"))
    out.backward(grad_out[:, :, mine])
    pairs = [(out, full[:, :, mine])] + [(s.grad, t.grad[:, :, mine]) for s, t in zip(shard, (q, k, v))]
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)


def ring_cases() -> dict[str, float]:
    from titanlite.parallel import document_ring

    document_ring.SCORE_TILE_ELEMENTS = 2 * 4 * 3 * 8  # 3 query rows per score tile: several tiles per shard
    return {
        f"{method} reset_positions={reset}": ring_against_plain_attention(method, reset)
        for method in ("allgather", "alltoall") for reset in (False, True)
    }


def _positions_reaching_the_model(dataset: str, folder: str) -> dict:
    """For each (attn_mask_type, reset_position_ids): the windows a real Trainer (byte tokenizer) ran,
    the positions it handed the model, the RoPE rows the first block's attention received (as
    (batch, seq, dim)) and the model's RoPE table."""
    from titanlite.config import parse_args
    from titanlite.trainer import Trainer

    seen, results = {}, {}
    for mask, reset in [("block_causal", True), ("block_causal", False), ("causal", False)]:
        overrides = ["--model.attn_mask_type", mask] + (["--model.reset_position_ids"] if reset else [])
        trainer = Trainer(parse_args(tiny_args(dataset, f"{folder}/{mask}-{reset}", *overrides)), torch.device("cpu"))
        model, bos, seq_len = trainer.model_parts[0], trainer.tokenizer.bos_id, trainer.config.training.seq_len
        model.register_forward_pre_hook(lambda m, args, kwargs: seen.update(positions=kwargs.get("positions")), with_kwargs=True)
        model.layers["0"].attention.register_forward_pre_hook(lambda m, args: seen.update(rope=args[1]))
        windows = torch.randint(0, bos, (2, seq_len + 1), generator=torch.Generator().manual_seed(0))
        windows[0, [0, 5, 6, 20]] = bos  # a document at the window's start, one of its BOS alone, one later
        windows[1, [9, seq_len - 1]] = bos  # the tail of an earlier document first, one at the last input
        with torch.no_grad():
            trainer.forward(windows[:, :-1], windows[:, 1:], backward=False)
        rope = seen["rope"] if seen["rope"].dim() == 3 else seen["rope"][:seq_len].expand(2, -1, -1)
        results[mask, reset] = {"inputs": windows[:, :-1], "bos": bos, "positions": seen["positions"],
                                "rope": rope, "table": model.rope}
    # Plain lists: tensors would cross to the test through shared memory that the rank's exit frees.
    return {case: {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in seen.items()}
            for case, seen in results.items()}


def positions_restarting_at_each_bos(row: list[int], bos: int) -> list[int]:
    """0 at the window's first token and at every BOS, counting up in between."""
    positions = []
    for i, token in enumerate(row):
        positions.append(0 if i == 0 or token == bos else positions[-1] + 1)
    return positions


@pytest.mark.slow
def test_reset_position_ids_reaches_the_models_rope(corpus_jsonl, tmp_path):
    """Trainer.forward on windows of several documents: with model.reset_position_ids the model is given
    positions that restart at each BOS, and its attention the RoPE rows of those positions; without it,
    0..seq_len-1 (block_causal hands them over, causal leaves the model its default). The loss cannot
    show this: RoPE is relative, so within a document restarting moves nothing but round-off."""
    (results,) = run_distributed(_positions_reaching_the_model, 1, str(corpus_jsonl), str(tmp_path))
    for (mask, reset), seen in results.items():
        inputs, table = torch.tensor(seen["inputs"]), torch.tensor(seen["table"])
        if reset:
            expected = torch.tensor([positions_restarting_at_each_bos(row, seen["bos"]) for row in seen["inputs"]])
            assert expected[0, :8].tolist() == [0, 1, 2, 3, 4, 0, 0, 1] and expected[1, 9] == 0
        else:
            expected = torch.arange(inputs.shape[1]).expand_as(inputs)
        if mask == "block_causal":
            assert seen["positions"] == expected.tolist(), (mask, reset, seen["positions"])
        else:
            assert seen["positions"] is None
        assert torch.equal(torch.tensor(seen["rope"]), table[expected]), (mask, reset)


@pytest.mark.slow
def test_document_ring_is_exact_on_an_odd_ring_with_shuffled_shards():
    """3 cp ranks, each holding a random third of the sequence: both rotations give masked
    attention's output and gradients (dk, dv summed over the ranks whose queries read them), also
    with positions restarting at each document, and with the scores computed in several tiles."""
    for worst in run_distributed(ring_cases, 3):
        assert all(diff < 1e-5 for diff in worst.values()), worst


@pytest.mark.slow
def test_block_causal_flavor_trains_through_the_cli_on_packed_text(corpus_jsonl, tmp_path):
    """TorchTitan's debugmodel_flex_attn flavor on CPU (the exact SDPA path runs, and says so), on
    text whose windows hold several documents: context parallel 2 (the document ring, head-tail
    balanced) follows 1 process's loss curve, and the masks change the curve against causal."""
    common = ["--training.steps", "6", "--training.seq_len", "128", "--training.local_batch_size", "4", "--validation.enable",
              "--validation.dataset", str(corpus_jsonl), "--validation.freq", "6", "--validation.seq_len", "128",
              "--validation.local_batch_size", "4"]
    runs = {
        "single": (1, ["--model.flavor", "debugmodel_flex_attn"]),
        "cp2": (2, ["--model.flavor", "debugmodel_flex_attn", "--parallelism.context_parallel_degree", "2"]),
        "causal": (1, []),
    }
    curves, logs = {}, {}
    for name, (nproc, extra) in runs.items():
        out = launch(nproc, tiny_args(corpus_jsonl, tmp_path / name, *common, *extra))
        rows = metrics(tmp_path / name)
        curves[name] = [r["loss"] for r in rows if "loss" in r] + [r["val_loss"] for r in rows if "val_loss" in r]
        logs[name] = out.stdout
    assert "masked SDPA with a boolean mask (flex not used: FlexAttention has no backward on cpu)" in logs["single"]
    kernels = next(line for line in logs["causal"].splitlines() if "attention kernels:" in line)
    assert kernels.endswith("attention kernels: causal SDPA (on CPU its flash kernel)"), kernels
    assert len(curves["single"]) == 7
    assert curve_difference(curves["cp2"], curves["single"]) < 1e-4, curves
    assert curve_difference(curves["causal"], curves["single"]) > 1e-3, curves


@pytest.mark.parametrize("capability, kernel, words", [
    (None, "sdpa", "SDPA (on CPU its flash kernel)"),
    ((7, 0), "sdpa", "SDPA's own choice on sm_70"),
    ((8, 0), "flash", "SDPA's FlashAttention-2 on sm_80"),
    ((8, 9), "flash", "SDPA's FlashAttention-2 on sm_89"),
    ((9, 0), "cudnn", "SDPA's cuDNN attention on sm_90"),
    ((10, 0), "cudnn", "SDPA's cuDNN attention on sm_100"),
    ((12, 0), "cudnn", "SDPA's cuDNN attention on sm_120"),
])
def test_causal_attention_picks_each_gpus_fastest_kernel(capability, kernel, words):
    from titanlite.models.common.attention import choose_causal_kernel

    assert choose_causal_kernel(capability) == (kernel, words)


def test_the_chosen_sdpa_backend_comes_first_falls_back_and_compiles(monkeypatch):
    """The causal kernel is a preference around SDPA (set_priority), not an order to use it alone: on
    CPU cuDNN's attention, which the CPU lacks, gives way to the CPU's flash kernel (as cuDNN's does
    to the others on a GPU for fp32 or deterministic runs); the context compiles in a fullgraph block."""
    from contextlib import contextmanager

    from torch.nn.attention import SDPBackend

    from titanlite.models.common import attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=gen) for _ in range(3))
    expected = CoreAttention()(q, k, v, None)
    monkeypatch.setattr(CoreAttention, "causal_kernel", "cudnn")
    torch.testing.assert_close(CoreAttention()(q, k, v, None), expected, rtol=0, atol=0)
    compiled = torch.compile(CoreAttention(), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v, None), expected, rtol=0, atol=0)
    entered = []

    @contextmanager
    def recorded(backends, set_priority=False):
        entered.append((backends, set_priority))
        yield

    monkeypatch.setattr(attention, "sdpa_kernel", recorded)
    CoreAttention()(q, k, v, None)
    cudnn_first = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    assert entered == [(cudnn_first, True)]

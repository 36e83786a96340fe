"""Parity: every data/tensor-parallel layout trains exactly like one process.

Each case builds the real Trainer (mesh, parallelize, init, optimizer, loss normalization,
clipping) for a layout and runs 5 optimizer steps on fixed random batches. In the same process a
plain PyTorch reference (the unparallelized model, same seed, full global batch, AdamW, same lr
schedule, clipping) runs the same steps. The initial weights must be identical, and at every step
the loss, every gradient (gathered with full_tensor), the grad norm and the updated weights must
agree to fp32 round-off. The CLI parity test compares free-running loss curves end to end. Cases
share one launch per world size, since process start dominates on CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from distributed import run_distributed
from helpers import tiny_args

STEPS = 5


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def parity_case(dataset: str, dump_folder: str, overrides: list[str]) -> dict:
    from titanlite.config import parse_args
    from titanlite.models.llama import Transformer, canonical_fqn
    from titanlite.optim import lr_factor
    from titanlite.train import Trainer

    config = parse_args(tiny_args(dataset, dump_folder, "--training.steps", str(STEPS), *overrides))
    trainer = Trainer(config, torch.device("cpu"))
    t, o, s = config.training, config.optimizer, config.lr_scheduler

    reference = Transformer(trainer.model_parts[0].args)
    reference.init_weights(t.seed)
    ref_opt = torch.optim.AdamW(  # the trainer's kernel too: fused and foreach round differently
        reference.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, fused=True
    )
    ref_sched = torch.optim.lr_scheduler.LambdaLR(
        ref_opt, lambda i: lr_factor(i, t.steps, s.warmup_steps, s.decay_ratio, s.decay_type, s.min_lr_factor)
    )
    ref_params = dict(reference.named_parameters())
    pairs = [
        (name, p, ref_params[canonical_fqn(name)]) for part in trainer.model_parts for name, p in part.named_parameters()
    ]
    worst = {"init": 0.0, "loss": 0.0, "grad": 0.0, "grad_norm": 0.0, "param": 0.0}

    def record(key: str, value: float, where: str) -> None:
        if value > worst[key]:
            worst[key], worst[f"{key}_at"] = value, where

    for name, p, ref in pairs:
        record("init", (full(p.detach()) - ref.detach()).abs().max().item(), name)

    rows_per_microbatch = t.local_batch_size * trainer.dp_degree
    gen = torch.Generator().manual_seed(1234)
    for step in range(STEPS):
        with torch.no_grad():  # each step starts from the trainer's weights (see ref.grad below)
            for name, p, ref in pairs:
                ref.copy_(full(p.detach()))
        tokens = torch.randint(
            0, trainer.tokenizer.vocab_size, (trainer.accumulation_steps * rows_per_microbatch, t.seq_len + 1), generator=gen
        )
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        # Microbatch i of data-parallel rank r takes rows [(i * dp + r) * B, ...): any split works,
        # the reference sees the whole global batch.
        microbatches = []
        for i in range(trainer.accumulation_steps):
            start = (i * trainer.dp_degree + trainer.dp_rank) * t.local_batch_size
            microbatches.append((inputs[start : start + t.local_batch_size], labels[start : start + t.local_batch_size]))
        loss = trainer.compute_gradients(microbatches)
        ref_loss = F.cross_entropy(reference(inputs).flatten(0, 1), labels.flatten())
        ref_loss.backward()
        record("loss", abs(loss - ref_loss.item()), f"step {step}")
        for name, p, ref in pairs:
            grad = full(p.grad)
            record("grad", ((grad - ref.grad).abs().max() / ref.grad.abs().max()).item(), f"{name} step {step}")
            # Step the reference on the trainer's gradients: Adam is elementwise, so a sharded update
            # must then match the full one exactly; Adam would turn round-off in near-zero gradients
            # into visible weight differences otherwise (even between two single-process runs).
            ref.grad.copy_(grad)

        grad_norm = trainer.apply_gradients()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), t.max_norm).item()
        record("grad_norm", abs(grad_norm - ref_norm) / ref_norm, f"step {step}")
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()
        for name, p, ref in pairs:
            record("param", (full(p.detach()) - ref.detach()).abs().max().item(), f"{name} after step {step}")
    return worst


def run_cases(dataset: str, dump_folder: str, cases: dict[str, list[str]]) -> dict:
    results = {}
    for name, overrides in cases.items():
        try:
            results[name] = parity_case(dataset, f"{dump_folder}/{name}", overrides)
        except Exception as e:
            raise RuntimeError(f"parity case '{name}' failed") from e
    return results


def check(results: list[dict]) -> None:
    """Initial weights bitwise; loss absolute; gradients relative to each tensor's largest entry;
    grad norm relative; weights absolute after each AdamW step."""
    for rank, by_case in enumerate(results):
        for case, worst in by_case.items():
            assert worst["init"] == 0.0, f"{case} rank {rank}: initial weights differ: {worst}"
            assert worst["loss"] < 1e-5, f"{case} rank {rank}: loss differs: {worst}"
            assert worst["grad"] < 1e-5, f"{case} rank {rank}: gradient differs (relative): {worst}"
            assert worst["grad_norm"] < 1e-5, f"{case} rank {rank}: grad norm differs (relative): {worst}"
            assert worst["param"] < 1e-6, f"{case} rank {rank}: weights differ after a step: {worst}"


TP = "--parallelism.tensor_parallel_degree"
PP = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"]


def schedule(name: str) -> list[str]:
    return ["--parallelism.pipeline_parallel_schedule", name]

CASES_2 = {
    "fsdp2": [],
    "fsdp2_grad_accumulation": ["--training.global_batch_size", "8"],
    "fsdp2_reshard_never": ["--parallelism.fsdp_reshard_after_forward", "never"],
    "ddp2": ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    "tp2_sp_lp": [TP, "2", "--model.flavor", "debugmodel_gqa"],
    "tp2_no_sp": [TP, "2", "--parallelism.enable_sequence_parallel", "false"],
    "tp2_no_lp": [TP, "2", "--parallelism.disable_loss_parallel"],
    "tp2_no_sp_no_lp": [TP, "2", "--parallelism.enable_sequence_parallel", "false", "--parallelism.disable_loss_parallel"],
}
# Pipeline parallel on 2 ranks: every single-stage schedule, every multi-stage one with 2 stages per
# rank (loop order, or V order for ZBVZeroBubble/DualPipeV), explicit stages, gradient accumulation.
CASES_PP2 = {
    "pp2_gpipe": PP + schedule("GPipe"),
    "pp2_1f1b": PP + schedule("1F1B"),
    "pp2_1f1b_grad_accumulation": PP + schedule("1F1B") + ["--training.global_batch_size", "8"],
    "pp2_1f1b_explicit_stages": PP + schedule("1F1B") + [
        "--parallelism.module_fqns_per_model_part", "tok_embeddings layers.0,layers.1 layers.2 layers.3 layers.4 layers.5 norm output"
    ],
    "pp2_interleaved1f1b": PP + schedule("Interleaved1F1B"),
    "pp2_loopedbfs": PP + schedule("LoopedBFS"),
    "pp2_interleavedzerobubble": PP + schedule("InterleavedZeroBubble"),
    "pp2_zbvzerobubble": PP + schedule("ZBVZeroBubble"),
    "pp2_dualpipev": PP + schedule("DualPipeV"),
}
CP = "--parallelism.context_parallel_degree"
# Context parallel: both rotate methods, with and without load balancing, and composed.
CASES_CP2 = {
    "cp2_allgather_headtail": [CP, "2"],
    "cp2_alltoall_headtail": [CP, "2", "--parallelism.context_parallel_rotate_method", "alltoall"],
    "cp2_allgather_no_balance": [CP, "2", "--parallelism.context_parallel_load_balancer", "none"],
    "cp2_alltoall_no_balance": [CP, "2", "--parallelism.context_parallel_rotate_method", "alltoall",
                                "--parallelism.context_parallel_load_balancer", "none"],
}
CASES_CP4 = {
    "cp4_allgather_headtail": [CP, "4"],
    "cp4_alltoall_headtail": [CP, "4", "--parallelism.context_parallel_rotate_method", "alltoall"],
    "cp4_allgather_no_balance": [CP, "4", "--parallelism.context_parallel_load_balancer", "none"],
    "cp4_alltoall_no_balance": [CP, "4", "--parallelism.context_parallel_rotate_method", "alltoall",
                                "--parallelism.context_parallel_load_balancer", "none"],
    "cp2_fsdp2": [CP, "2", "--model.flavor", "debugmodel_gqa"],
    "cp2_tp2": [CP, "2", TP, "2", "--model.flavor", "debugmodel_gqa"],
    "cp2_pp2": [CP, "2"] + PP,
}
CASES_4 = {
    "hsdp2x2": ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"],
    "fsdp2_tp2": [TP, "2", "--model.flavor", "debugmodel_gqa"],
    "ddp2_tp2": [TP, "2", "--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    "pp4_1f1b": ["--parallelism.pipeline_parallel_degree", "4", "--training.local_batch_size", "4"],
    "pp2_fsdp2_interleaved1f1b": PP + schedule("Interleaved1F1B"),
    "pp2_tp2_1f1b": PP + [TP, "2"],
}
CASES_8 = {
    "pp2_fsdp2_tp2_1f1b": PP + [TP, "2", "--model.flavor", "debugmodel_gqa"],
}


@pytest.mark.slow
def test_parity_two_ranks(corpus_jsonl, tmp_path):
    check(run_distributed(run_cases, 2, str(corpus_jsonl), str(tmp_path), CASES_2))


@pytest.mark.slow
def test_pipeline_parity_two_ranks(corpus_jsonl, tmp_path):
    check(run_distributed(run_cases, 2, str(corpus_jsonl), str(tmp_path), CASES_PP2))


@pytest.mark.slow
def test_context_parity_two_ranks(corpus_jsonl, tmp_path):
    check(run_distributed(run_cases, 2, str(corpus_jsonl), str(tmp_path), CASES_CP2))


@pytest.mark.slow
def test_context_parity_four_ranks(corpus_jsonl, tmp_path):
    check(run_distributed(run_cases, 4, str(corpus_jsonl), str(tmp_path), CASES_CP4))


@pytest.mark.slow
def test_parity_eight_ranks(corpus_jsonl, tmp_path):
    check(run_distributed(run_cases, 8, str(corpus_jsonl), str(tmp_path), CASES_8))


@pytest.mark.slow
def test_parity_four_ranks(corpus_jsonl, tmp_path):
    check(run_distributed(run_cases, 4, str(corpus_jsonl), str(tmp_path), CASES_4))

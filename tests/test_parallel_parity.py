"""Parity: every data/tensor-parallel layout trains exactly like one process.

Each case builds the real Trainer (mesh, parallelize, init, optimizer, loss normalization,
clipping) for a layout and runs 4 optimizer steps on fixed random batches. In the same process a
plain PyTorch reference (the unparallelized model, same seed, full global batch, AdamW, same lr
schedule, clipping) runs the same steps. The initial weights must be identical, and at every step
the loss, every gradient, the grad norm and the updated weights must agree to fp32 round-off (each
rank compares its own shards with the matching slices of the reference, without communication).
Then both evaluate the same validation batches, which must give the same loss.

With block-causal attention (document masks) the batches hold several documents per window, and
the reference runs each document of each window on its own: the layout's packed windows must give
the same losses and gradients as the documents alone (the 1-process packed run equals them too:
tests/test_attention.py).

Lockstep cases hand both optimizers the reference's gradients, so each step starts from equal
weights and gradients are compared without drift. Free-running cases ("free_...") let the trainer
clip and step on its own gradients for all steps, compared within the drift that fp32 round-off
alone causes. A NaN anywhere fails a case. Cases share one launch per world size, since process
start dominates on CPU.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from distributed import run_distributed
from helpers import tiny_args

STEPS = 4
VALIDATION_STEPS = 2
KEYS = ("init", "loss", "grad", "grad_l2", "grad_norm", "param", "expert_bias", "validation")
# Free-running bounds (over 4 steps, lr 8e-4). Two 1-process runs that differ only in the order of
# summation (the batch as one or as two accumulated microbatches) drift by 1e-6 in loss, 8e-7 in a
# gradient (relative L2), 8e-8 in the grad norm (relative) and 2e-6 in a weight; the free-running
# layouts here measured at most 1e-6, 5e-6, 2e-6 and 9e-6. The bounds leave 10x that; a wrong
# reduction (a dropped or doubled sum) is off by 1e-3 in loss and O(1) in gradients.
FREE_RUNNING = {"loss": 1e-5, "grad_l2": 1e-4, "grad_norm": 1e-4, "param": 1e-4}


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def as_laid_out(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A full tensor laid out like `like` (a DTensor keeps this rank's slice; no communication)."""
    if isinstance(like, DTensor):
        return distribute_tensor(full.clone(), like.device_mesh, like.placements, src_data_rank=None)
    return full.clone()


def local_slice(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return local(as_laid_out(full, like))


def reduced(grad: torch.Tensor) -> torch.Tensor:
    """Gradients of replicated parameters may still be pending sums (Partial): reduce those."""
    if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
        return grad.redistribute(grad.device_mesh, [Replicate() if pl.is_partial() else pl for pl in grad.placements])
    return grad


def parity_case(dataset: str, dump_folder: str, overrides: list[str], free_running: bool = False) -> dict:
    from titanlite.config import float8_recipe, parse_args
    from titanlite.data.dataset import build_dataloader
    from titanlite.float8 import convert_to_float8
    from titanlite.loss import cross_entropy_sum  # the trainer's (test_loss.py holds it to torch's)
    from titanlite.models.attention import document_layout
    from titanlite.models.llama import canonical_fqn
    from titanlite.models.moe import global_balance, set_batch, update_expert_bias
    from titanlite.optim import lr_factor
    from titanlite.parallel.parallelize import assign_full_value
    from titanlite.train import Trainer

    validation = ["--validation.dataset", dataset, "--validation.steps", str(VALIDATION_STEPS), "--training.data_split", "sequences"]
    config = parse_args(tiny_args(dataset, dump_folder, "--training.steps", str(STEPS), *validation, *overrides))
    config.validation.local_batch_size = config.training.local_batch_size  # the pipeline's stages have fixed shapes
    trainer = Trainer(config, torch.device("cpu"))
    t, o, s = config.training, config.optimizer, config.lr_scheduler

    # Separate projections: a layout's fused ones (model.fused_projections) must give the same results.
    reference = trainer.plan.build(replace(trainer.model_parts[0].args, fused_projections=False))
    reference.init_weights(trainer.seed)
    ref_moe = trainer.plan.moe_layers(reference)
    set_batch(ref_moe, trainer.accumulation_steps * t.local_batch_size * trainer.dp_degree, t.seq_len)
    if config.float8:
        convert_to_float8(reference, float8_recipe(config.float8), trainer.converters[0].filter_fqns(trainer.plan), config.float8.emulate)
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
    worst = dict.fromkeys(KEYS, 0.0)

    def record(key: str, value: float, where: str) -> None:
        if not value <= worst[key]:  # also true for NaN, which then stays: nothing compares above it
            worst[key], worst[f"{key}_at"] = (math.inf if math.isnan(value) else value), where

    for name, p, ref in pairs:
        record("init", (local(p.detach()) - local_slice(ref.detach(), p)).abs().max().item(), name)

    def reference_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Summed cross entropy of the reference; with document masks, of each document alone (but of
        the packed windows where other tokens count: float8 scales by the batch, the aux loss by the window)."""
        if not trainer.document_masking or config.float8 or trainer.aux_loss_on:
            token_inputs = trainer.token_inputs(x) if trainer.document_masking else {}
            return cross_entropy_sum(reference(x, **token_inputs), y)
        document_ids, _ = document_layout(x, trainer.tokenizer.bos_id, reset_positions=False)
        total = torch.zeros(())
        for row, ids in enumerate(document_ids):
            for document in ids.unique():
                tokens = ids == document
                total = total + cross_entropy_sum(reference(x[row, tokens][None]), y[row, tokens][None])
        return total

    rows_per_microbatch = t.local_batch_size * trainer.dp_degree
    gen = torch.Generator().manual_seed(1234)
    for step in range(STEPS):
        tokens = torch.randint(
            0, trainer.tokenizer.vocab_size, (trainer.accumulation_steps * rows_per_microbatch, t.seq_len + 1), generator=gen
        )
        if trainer.document_masking:  # documents start at 3 random places in each window
            starts = torch.randint(0, t.seq_len, (len(tokens), 3), generator=gen)
            tokens.scatter_(1, starts, trainer.tokenizer.bos_id)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        # Microbatch i of data-parallel rank r takes rows [(i * dp + r) * B, ...): any split works,
        # the reference sees the whole global batch.
        microbatches = []
        for i in range(trainer.accumulation_steps):
            start = (i * trainer.dp_degree + trainer.dp_rank) * t.local_batch_size
            microbatches.append((inputs[start : start + t.local_batch_size], labels[start : start + t.local_batch_size]))
        loss = trainer.global_loss(trainer.compute_gradients(microbatches))
        # Float8 activation scales come from the batch a rank sees, so the float8 reference runs
        # each rank's microbatch on its own (the sum is the same loss in exact arithmetic).
        rows = t.local_batch_size if config.float8 else len(inputs)
        ref_loss = sum(reference_loss(x, y) for x, y in zip(inputs.split(rows), labels.split(rows))) / labels.numel()
        ref_loss.backward()
        record("loss", abs(loss - ref_loss.item()), f"step {step}")
        for name, p, ref in pairs:
            grad = reduced(p.grad)
            diff = local(grad) - local_slice(ref.grad, grad)
            record("grad", (diff.abs().max() / ref.grad.abs().max()).item(), f"{name} step {step}")
            record("grad_l2", (diff.norm() / local_slice(ref.grad, grad).norm()).item(), f"{name} step {step}")
            if not free_running:
                # Both optimizers step on the same gradients: Adam is elementwise, so the sharded update
                # must then match the full one exactly, where Adam would otherwise turn round-off in
                # near-zero gradients into visible weight differences (even between two 1-process runs).
                p.grad = as_laid_out(ref.grad, p)

        grad_norm = trainer.apply_gradients().item()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), t.max_norm).item()
        record("grad_norm", abs(grad_norm - ref_norm) / ref_norm, f"step {step}")
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()
        update_expert_bias(ref_moe, global_balance(ref_moe, None)[0])  # MoE: the reference's balancing step
        ref_buffers = dict(reference.named_buffers())
        for part in trainer.model_parts:
            for name, buffer in part.named_buffers():
                if name.endswith("expert_bias"):
                    record("expert_bias", (buffer - ref_buffers[canonical_fqn(name)]).abs().max().item(), f"{name} step {step}")
        for name, p, ref in pairs:
            record("param", (local(p.detach()) - local_slice(ref.detach(), p)).abs().max().item(), f"{name} after step {step}")
            if not free_running:
                assign_full_value(p, ref.detach())  # the next step starts from identical weights

    # Validation: the trainer's loss over the first VALIDATION_STEPS global batches of the held-out
    # stream ("sequences" split: rank r reads rows r*B.. of each) against the reference's.
    val_loss = trainer.validate()
    reference.eval()
    with torch.no_grad():
        loader = build_dataloader(config, trainer.tokenizer, 0, 1, split="validation")
        loss_sum = tokens = 0
        for _, (x, y) in zip(range(VALIDATION_STEPS * trainer.dp_degree), loader):
            loss_sum += reference_loss(x, y).item()
            tokens += y.numel()
    record("validation", abs(val_loss - loss_sum / tokens), "validation")

    # Each rank compared its own shards: the worst over all ranks decides (NaN was recorded as inf).
    values = torch.tensor([worst[k] for k in KEYS], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    worst.update(zip(KEYS, values.tolist()))
    return worst


def run_cases(dataset: str, dump_folder: str, cases: dict[str, list[str]]) -> dict:
    results = {}
    for name, overrides in cases.items():
        # Each case stands for a job of its own: compiled graphs hold the process groups of the
        # case that compiled them, so none may be reused by the next.
        torch._dynamo.reset()
        try:
            results[name] = parity_case(dataset, f"{dump_folder}/{name}", overrides, free_running=name.startswith("free_"))
        except Exception as e:
            raise RuntimeError(f"parity case '{name}' failed") from e
    return results


# Float8 rounding is discontinuous: under tensor parallel, fp32 round-off (row-parallel outputs summed
# over ranks in another order; under sequence parallel also norms on sequence shards) now and then
# flips one float8 rounding of a gradient, and the layers behind it get a gradient a few percent off
# at that step (measured: exact in most steps and layers; tp2_float8 once 4% (L2) in layer 0 of 6,
# tp2_float8_no_sp 4.7% in layer 0 at step 3 when run on its own). With FSDP alone float8 matches
# exactly; losses match tightly everywhere.
ROUNDING_FLIPS = {"tp2_float8", "tp2_float8_no_sp", "tp2_float8_rowwise_with_gw_hp", "tp2_float8_attention_filtered",
                  "fsdp2_tp2_float8_all_gather", "moe_ep4_tp2_float8"}


def check(results: list[dict]) -> None:
    """Initial weights bitwise; loss absolute; gradients relative to each tensor's largest entry
    (or in L2 where float8 roundings flip); grad norm relative; weights absolute after each AdamW step;
    validation loss absolute. Free-running cases: within FREE_RUNNING's drift bounds."""
    assert results and all(results), "no case ran"
    for rank, by_case in enumerate(results):
        for case, worst in by_case.items():
            where = f"{case} rank {rank}"
            assert worst["init"] == 0.0, f"{where}: initial weights differ: {worst}"
            assert worst["validation"] < 1e-5, f"{where}: validation loss differs: {worst}"
            if case.startswith("free_"):
                for key, bound in FREE_RUNNING.items():
                    assert worst[key] < bound, f"{where}: free-running {key} beyond {bound}: {worst}"
                continue
            assert worst["loss"] < 1e-5, f"{where}: loss differs: {worst}"
            if case in ROUNDING_FLIPS:
                assert worst["grad_l2"] < 0.1, f"{where}: gradient differs (relative L2): {worst}"
            else:
                assert worst["grad"] < 1e-5, f"{where}: gradient differs (relative): {worst}"
            assert worst["grad_norm"] < 1e-5, f"{where}: grad norm differs (relative): {worst}"
            assert worst["param"] < 1e-6, f"{where}: weights differ after a step: {worst}"
            assert worst["expert_bias"] == 0.0, f"{where}: MoE expert bias differs after a step: {worst}"


TP = "--parallelism.tensor_parallel_degree"
F8 = ["--model.converters", "float8", "--quantize.linear.float8.emulate"]
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
    # q/k/v and w1/w3 as one matmul each: every rank's rows of them, gathered input, partial input gradient.
    "tp2_fused_projections": [TP, "2", "--model.flavor", "debugmodel_gqa", "--model.fused_projections"],
    "tp2_separate_projections": [TP, "2", "--model.flavor", "debugmodel_gqa", "--model.fused_projections", "false"],
    "tp2_no_sp_separate_projections": [TP, "2", "--parallelism.enable_sequence_parallel", "false", "--model.fused_projections", "false"],
    "fsdp2_separate_projections_ac_selective_op": ["--model.fused_projections", "false", "--activation_checkpoint.mode", "selective"],
    # Compiled attention and feed-forward under TP trace the fused matmul, also without autograd (validation).
    "tp2_compile_fused_projections": [TP, "2", "--compile.enable", "--model.fused_projections"],
    # Activation checkpointing recomputes, so results must not change at all.
    "fsdp2_ac_full": ["--activation_checkpoint.mode", "full"],
    "fsdp2_ac_selective_op": ["--activation_checkpoint.mode", "selective"],
    "tp2_ac_every_2nd_block": [TP, "2", "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
    # torch.compile (inductor) of blocks and loss: the same math up to fp32 reassociation. (TP 2 and
    # CP 2 alone compile and match too; the suite keeps FSDP 2 x TP 2 for time.)
    "fsdp2_compile_ac_op": ["--compile.enable", "--activation_checkpoint.mode", "selective"],
    # float8 (emulated matmuls: the same float8 rounding as _scaled_mm, fast on CPU).
    "fsdp2_float8_all_gather": F8 + ["--quantize.linear.float8.enable_fsdp_float8_all_gather"],
    "fsdp2_float8_all_gather_precomputed": F8 + ["--quantize.linear.float8.enable_fsdp_float8_all_gather",
                                                 "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"],
    "fsdp2_float8_rowwise": F8 + ["--quantize.linear.float8.recipe_name", "rowwise"],
    "tp2_float8": F8 + [TP, "2"],
    "tp2_float8_no_sp": F8 + [TP, "2", "--parallelism.enable_sequence_parallel", "false"],
    "tp2_float8_rowwise_with_gw_hp": F8 + [TP, "2", "--quantize.linear.float8.recipe_name", "rowwise_with_gw_hp"],
    # Attention's projections filtered out of float8: its sequence-parallel gather stays exact.
    "tp2_float8_attention_filtered": F8 + [TP, "2", "--quantize.linear.float8.filter_fqns", "output,attention"],
    "free_fsdp2": [],
    "free_tp2": [TP, "2"],
}
# Pipeline parallel on 2 ranks: every single-stage schedule, every multi-stage one with 2 stages per
# rank (loop order, or V order for ZBVZeroBubble/DualPipeV), explicit stages, gradient accumulation.
CASES_PP2 = {
    "pp2_gpipe": PP + schedule("GPipe"),
    "pp2_1f1b": PP + schedule("1F1B"),
    "pp2_1f1b_grad_accumulation": PP + schedule("1F1B") + ["--training.global_batch_size", "8"],
    "pp2_1f1b_explicit_stages": PP + schedule("1F1B") + [
        "--parallelism.module_fqns_per_model_part", "[[\"tok_embeddings\", \"layers.0\"], [\"layers.1\", \"layers.2\", \"layers.3\", \"layers.4\", \"layers.5\", \"norm\", \"output\"]]"
    ],
    "pp2_interleaved1f1b": PP + schedule("Interleaved1F1B"),
    "pp2_loopedbfs": PP + schedule("LoopedBFS"),
    "pp2_interleavedzerobubble": PP + schedule("InterleavedZeroBubble"),
    "pp2_zbvzerobubble": PP + schedule("ZBVZeroBubble"),
    "pp2_dualpipev": PP + schedule("DualPipeV"),
    "free_pp2_zbvzerobubble": PP + schedule("ZBVZeroBubble"),
}
CP = "--parallelism.context_parallel_degree"
# Context parallel: both rotate methods, with and without load balancing, and composed.
CASES_CP2 = {
    "cp2_allgather_headtail": [CP, "2"],
    "cp2_alltoall_headtail": [CP, "2", "--parallelism.context_parallel_rotate_method", "alltoall"],
    "cp2_allgather_no_balance": [CP, "2", "--parallelism.context_parallel_load_balancer", "none"],
    "cp2_alltoall_no_balance": [CP, "2", "--parallelism.context_parallel_rotate_method", "alltoall",
                                "--parallelism.context_parallel_load_balancer", "none"],
    "free_cp2": [CP, "2"],
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
    "fsdp2_tp2_compile_fused_projections": [TP, "2", "--model.flavor", "debugmodel_gqa", "--compile.enable", "--model.fused_projections"],
    "fsdp2_tp2_separate_projections": [TP, "2", "--model.flavor", "debugmodel_gqa", "--model.fused_projections", "false"],
    "fsdp2_tp2_float8_all_gather": F8 + [TP, "2", "--model.flavor", "debugmodel_gqa", "--quantize.linear.float8.enable_fsdp_float8_all_gather",
                                         "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"],
    "free_fsdp2_tp2": [TP, "2", "--model.flavor", "debugmodel_gqa"],
    "free_hsdp2x2": ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"],
}
CASES_8 = {
    "pp2_fsdp2_tp2_1f1b": PP + [TP, "2", "--model.flavor", "debugmodel_gqa"],
    "pp2_cp2_tp2_ac_op": PP + [CP, "2", TP, "2", "--model.flavor", "debugmodel_gqa", "--activation_checkpoint.mode", "selective"],
}

MOE = ["--model.name", "moe", "--model.flavor", "debugmoe"]
MOE_SIGMOID_AUX = ["--model.name", "moe", "--model.flavor", "debugmoe_sigmoid", "--model.moe_aux_loss_coeff", "0.01"]
EP, ETP = "--parallelism.expert_parallel_degree", "--parallelism.expert_tensor_parallel_degree"
# Mixture of experts (with a shared expert; or sigmoid routing without one, plus the aux loss): the
# experts split over ranks borrowed from dp_shard and cp, composed with FSDP, HSDP, CP, PP and AC.
CASES_MOE_2 = {
    "moe_fsdp2": MOE,
    "moe_ep2": MOE + [EP, "2"],
    "moe_ep2_loop": MOE + [EP, "2", "--model.moe_grouped_mm", "false"],
    "moe_ep2_sigmoid_aux": MOE_SIGMOID_AUX + [EP, "2"],
    "moe_ep2_ac_full": MOE_SIGMOID_AUX + [EP, "2", "--activation_checkpoint.mode", "full"],
    "moe_ep2_ac_selective_op": MOE + [EP, "2", "--activation_checkpoint.mode", "selective"],
    "moe_pp2_dualpipev_aux": MOE_SIGMOID_AUX + PP + schedule("DualPipeV"),
    "moe_cp2_ep2": MOE + [CP, "2", EP, "2"],
    "moe_pp2_aux": MOE_SIGMOID_AUX + PP + schedule("1F1B"),
    "moe_pp2_zbv_aux": MOE_SIGMOID_AUX + PP + schedule("ZBVZeroBubble"),
    "moe_pp2_interleaved_aux": MOE_SIGMOID_AUX + PP + schedule("Interleaved1F1B"),
    # Compiled attention and dense FFNs (MoE layers stay eager); float8 on the dense linears.
    "moe_ep2_compile": MOE + [EP, "2", "--compile.enable"],
    "moe_ep2_float8": MOE + F8 + [EP, "2"],
    # Tensor parallel: attention split by heads, each tp rank routing its sequence shard (EP borrows tp).
    "moe_tp2_separate_projections": MOE + [TP, "2", "--model.fused_projections", "false"],
    "moe_ep2_tp2_aux": MOE_SIGMOID_AUX + [EP, "2", TP, "2"],
    # Expert tensor parallel: each expert's hidden dim split over tp.
    "moe_tp2_etp2_loop": MOE + [TP, "2", ETP, "2", "--model.moe_grouped_mm", "false"],
    "free_moe_ep2": MOE + [EP, "2"],
}
CASES_MOE_4 = {
    "moe_ep2_fsdp2": MOE + [EP, "2"],
    "moe_ep4_aux": MOE_SIGMOID_AUX + [EP, "4"],
    "moe_hsdp2x2_ep2": MOE + ["--parallelism.data_parallel_replicate_degree", "2", EP, "2"],
    "moe_pp2_ep2_aux": MOE_SIGMOID_AUX + PP + [EP, "2"],
    "moe_cp2_ep4_aux": MOE_SIGMOID_AUX + [CP, "2", EP, "4"],
    "moe_fsdp2_tp2_aux": MOE_SIGMOID_AUX + [TP, "2"],
    "moe_ep2_tp2_etp2_aux": MOE_SIGMOID_AUX + [EP, "2", TP, "2", ETP, "2"],
    "moe_cp2_tp2_etp2": MOE + [CP, "2", TP, "2", ETP, "2"],
    "moe_ep2_fsdp2_tp2": MOE + [EP, "2", TP, "2"],
    # Under TP a MoE layer's float8 linears (shared experts) would scale by the tp rank's tokens, not
    # the whole sequence the reference sees: filtered here, so float8 covers the attention.
    "moe_ep4_tp2_float8": MOE + F8 + [EP, "4", TP, "2", "--quantize.linear.float8.filter_fqns", "output,shared_experts"],
    "moe_pp2_ep2_tp2": MOE + PP + [EP, "2", TP, "2"],
    "moe_cp2_tp2_ep4_aux": MOE_SIGMOID_AUX + [CP, "2", TP, "2", EP, "4"],
}

BC = ["--model.attn_mask_type", "block_causal"]
BC_RESET = BC + ["--model.reset_position_ids"]
# Document masks (block-causal attention) against each document alone, on every layout: the mask
# reaches every pipeline stage (and its microbatches), is shared by the tp ranks' heads, and under
# context parallel each KV shard's document ids and positions travel around the ring with it.
CASES_DOC_2 = {
    "doc_fsdp2": BC,
    "doc_fsdp2_reset_positions_grad_accumulation": BC_RESET + ["--training.global_batch_size", "8"],
    "doc_tp2": BC + [TP, "2", "--model.flavor", "debugmodel_gqa"],
    "doc_pp2_1f1b": BC + PP + schedule("1F1B"),
    "doc_pp2_zbvzerobubble": BC_RESET + PP + schedule("ZBVZeroBubble"),
    "doc_cp2_allgather_headtail": BC + [CP, "2", "--model.flavor", "debugmodel_gqa"],
    "doc_cp2_alltoall_headtail": BC + [CP, "2", "--parallelism.context_parallel_rotate_method", "alltoall"],
    "doc_cp2_alltoall_no_balance_reset_positions": BC_RESET + [CP, "2", "--parallelism.context_parallel_rotate_method", "alltoall",
                                                              "--parallelism.context_parallel_load_balancer", "none"],
    "doc_fsdp2_ac_selective_op": BC + ["--activation_checkpoint.mode", "selective"],
    "doc_fsdp2_compile": BC + ["--compile.enable"],
    "doc_fsdp2_float8": BC + F8,
    "doc_moe_ep2": BC + MOE + [EP, "2"],
}
CASES_DOC_4 = {
    "doc_cp4_alltoall_headtail": BC + [CP, "4", "--parallelism.context_parallel_rotate_method", "alltoall"],
    "doc_cp2_tp2_ac_full": BC + [CP, "2", TP, "2", "--model.flavor", "debugmodel_gqa", "--activation_checkpoint.mode", "full"],
    "doc_cp2_pp2_ac_selective_op": BC_RESET + [CP, "2"] + PP + ["--activation_checkpoint.mode", "selective"],
    "doc_cp2_fsdp2_compile": BC + [CP, "2", "--compile.enable"],
    "doc_moe_cp2_ep2_aux": BC + MOE_SIGMOID_AUX + [CP, "2", EP, "2"],
}


# The extended matrix: variants of layouts the default cases already cover (another float8 recipe,
# rotate method or schedule of the same degree, a balancer off, ...). `pytest -m full` or
# scripts/test_full.sh runs them; the default test command leaves them out to stay under 20 minutes.
EXTENDED = {
    "fsdp2_reshard_never", "tp2_no_lp", "fsdp2_float8_all_gather_precomputed", "tp2_float8_no_sp",
    "tp2_float8_rowwise_with_gw_hp", "tp2_float8_attention_filtered", "pp2_loopedbfs", "pp2_interleavedzerobubble",
    "free_pp2_zbvzerobubble", "cp2_alltoall_no_balance", "moe_ep2_loop", "moe_pp2_zbv_aux", "moe_pp2_interleaved_aux",
    "doc_fsdp2_float8", "doc_fsdp2_ac_selective_op",
    "ddp2_tp2", "pp2_fsdp2_interleaved1f1b", "fsdp2_tp2_float8_all_gather", "free_hsdp2x2", "cp4_allgather_no_balance",
    "cp4_alltoall_no_balance", "moe_ep2_tp2_etp2_aux", "moe_cp2_tp2_etp2", "moe_pp2_ep2_tp2", "moe_cp2_tp2_ep4_aux",
    "doc_cp2_fsdp2_compile", "pp2_gpipe", "tp2_ac_every_2nd_block", "moe_ep2_ac_full", "fsdp2_float8_rowwise",
    "cp2_allgather_no_balance", "moe_ep4_tp2_float8", "moe_hsdp2x2_ep2", "free_fsdp2_tp2", "moe_ep2_fsdp2_tp2",
    "fsdp2_tp2_compile_fused_projections", "moe_ep2_compile", "moe_cp2_ep4_aux", "moe_pp2_ep2_aux",
    "tp2_no_sp", "free_tp2", "tp2_no_sp_separate_projections", "fsdp2_tp2_separate_projections", "tp2_compile_fused_projections",
    "fsdp2_separate_projections_ac_selective_op", "pp2_1f1b_explicit_stages", "pp2_dualpipev", "moe_ep2_sigmoid_aux", "moe_tp2_etp2_loop",
    "moe_ep2_ac_selective_op", "doc_pp2_zbvzerobubble", "doc_cp2_alltoall_headtail", "doc_fsdp2_compile", "fsdp2_ac_selective_op", "moe_pp2_aux",
    "cp4_alltoall_headtail", "moe_ep4_aux", "pp2_tp2_1f1b", "doc_cp4_alltoall_headtail", "pp2_cp2_tp2_ac_op", "cp2_pp2",
    "tp2_sp_lp", "free_cp2", "doc_fsdp2",
}
TWO_RANKS = CASES_2 | CASES_PP2 | CASES_CP2 | CASES_MOE_2 | CASES_DOC_2
FOUR_RANKS = CASES_4 | CASES_CP4 | CASES_MOE_4 | CASES_DOC_4


def cases(matrix: dict, extended: bool) -> dict:
    return {name: overrides for name, overrides in matrix.items() if (name in EXTENDED) == extended}


# One launch per world size: process start dominates on CPU.
@pytest.mark.parametrize("world, matrix, extended", [
    pytest.param(2, TWO_RANKS, False, marks=pytest.mark.slow, id="two_ranks"),
    pytest.param(4, FOUR_RANKS, False, marks=pytest.mark.slow, id="four_ranks"),
    pytest.param(8, CASES_8, False, marks=pytest.mark.slow, id="eight_ranks"),
    pytest.param(2, TWO_RANKS, True, marks=pytest.mark.full, id="two_ranks_extended"),
    pytest.param(4, FOUR_RANKS, True, marks=pytest.mark.full, id="four_ranks_extended"),
    pytest.param(8, CASES_8, True, marks=pytest.mark.full, id="eight_ranks_extended"),
])
def test_parity(world, matrix, extended, corpus_jsonl, tmp_path):
    check(run_distributed(run_cases, world, str(corpus_jsonl), str(tmp_path), cases(matrix, extended)))


def test_every_extended_case_exists():
    every = set(TWO_RANKS) | set(FOUR_RANKS) | set(CASES_8)
    assert EXTENDED <= every, EXTENDED - every

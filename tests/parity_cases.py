"""The parity matrix of test_parallel_parity.py: each case is a layout's CLI overrides, grouped by the
world size of the launch that runs it (process start dominates on CPU, so cases share launches)."""

from __future__ import annotations

TP = "--parallelism.tensor_parallel_degree"
F8 = ["--model.converters", "float8", "--quantize.linear.float8.emulate"]
# torch.compile on aot_eager: dynamo's trace, AOTAutograd's joint graph and partition (AC's recompute
# included) and the custom ops' shape functions, as inductor gets them, without inductor's C++ build,
# which costs 30-110 s a case on a cold cache on 2 cores. Inductor's own numerics: the *_compile cases
# without it (dense blocks, whole MoE blocks, TP, EP, document masks).
AOT_EAGER = ["--compile.enable", "--compile.backend", "aot_eager"]
F8_GROUPED = ["--model.converters", "quantize.grouped_mm.float8", "--quantize.grouped_mm.float8.fqns", "experts"]
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
    # q/k/v as one matmul: every rank's rows of them, gathered input, partial input gradient.
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
ALLTOALL = ["--parallelism.context_parallel_rotate_method", "alltoall"]
NO_BALANCE = ["--parallelism.context_parallel_load_balancer", "none"]


def rotations_and_balancers(degree: int) -> dict[str, list[str]]:
    return {
        f"cp{degree}_allgather_headtail": [CP, str(degree)],
        f"cp{degree}_alltoall_headtail": [CP, str(degree), *ALLTOALL],
        f"cp{degree}_allgather_no_balance": [CP, str(degree), *NO_BALANCE],
        f"cp{degree}_alltoall_no_balance": [CP, str(degree), *ALLTOALL, *NO_BALANCE],
    }


CASES_CP2 = {
    **rotations_and_balancers(2),
    "free_cp2": [CP, "2"],
}
CASES_CP4 = {
    **rotations_and_balancers(4),
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
    "fsdp2_tp2_compile_fused_projections": [TP, "2", "--model.flavor", "debugmodel_gqa", *AOT_EAGER, "--model.fused_projections"],
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
# Qwen's global-batch balance loss: its expert counts span every rank that routes the forward's tokens.
MOE_GLOBAL_AUX = MOE + ["--model.moe_aux_loss_coeff", "0.1", "--model.moe_aux_loss_type", "global_batch"]
CHUNKED_LOSS = ["--training.loss_chunks", "3"]
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
    # Compiled attention and dense FFNs (under EP the MoE layers stay eager); float8 on the dense linears.
    "moe_ep2_compile": MOE + [EP, "2", "--compile.enable"],
    # Whole MoE blocks compiled (inductor): grouped GEMMs, counts and the aux loss in the graph, under AC.
    "moe_fsdp2_compile_ac_op_aux": MOE_SIGMOID_AUX + ["--compile.enable", "--activation_checkpoint.mode", "selective"],
    "moe_ep2_float8": MOE + F8 + [EP, "2"],
    # Float8 grouped GEMMs for the routed experts (rowwise, emulated on CPU).
    "moe_fsdp2_float8_grouped": MOE + F8_GROUPED,
    "moe_ep2_float8_grouped": MOE + F8_GROUPED + [EP, "2"],
    # Tensor parallel: attention split by heads, each tp rank routing its sequence shard (EP borrows tp).
    "moe_tp2_separate_projections": MOE + [TP, "2", "--model.fused_projections", "false"],
    "moe_ep2_tp2_aux": MOE_SIGMOID_AUX + [EP, "2", TP, "2"],
    # Expert tensor parallel: each expert's hidden dim split over tp.
    "moe_tp2_etp2_loop": MOE + [TP, "2", ETP, "2", "--model.moe_grouped_mm", "false"],
    "free_moe_ep2": MOE + [EP, "2"],
    "moe_fsdp2_global_aux": MOE_GLOBAL_AUX,
    "moe_cp2_ep2_global_aux": MOE_GLOBAL_AUX + [CP, "2", EP, "2"],
    "moe_tp2_global_aux": MOE_GLOBAL_AUX + [TP, "2"],
    # Each forward is its own global batch: accumulation steps and pipeline microbatches.
    "moe_fsdp2_global_aux_grad_accumulation": MOE_GLOBAL_AUX + ["--training.global_batch_size", "8"],
    "moe_pp2_global_aux": MOE_GLOBAL_AUX + PP + schedule("1F1B"),
    # The output projection and loss a piece of the tokens at a time (the reference builds the logits).
    "fsdp2_chunked_loss": CHUNKED_LOSS,
    "pp2_1f1b_chunked_loss": CHUNKED_LOSS + PP + schedule("1F1B"),
    "cp2_chunked_loss": CHUNKED_LOSS + [CP, "2"],
    "moe_ep2_chunked_loss": CHUNKED_LOSS + MOE + [EP, "2"],
    # Under TP each rank's rows of the output weight: the vocabulary split as loss parallel splits it.
    "tp2_chunked_loss": CHUNKED_LOSS + [TP, "2", "--model.flavor", "debugmodel_gqa"],
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
    "moe_cp2_tp2_ep4_global_aux": MOE_GLOBAL_AUX + [CP, "2", TP, "2", EP, "4"],
    # One expert per EP rank, FSDP-sharded over 2 ranks: along dim 1.
    "moe_ep2_fsdp2_experts_dim1": MOE + [EP, "2", "--model.flavor_overrides", "num_experts=2"],
    # Recompute replays the exchanges of its forward (1F1B: one recompute per forward, in order); the
    # split-backward schedules may recompute a block twice, so there it exchanges again.
    "moe_pp2_ep2_ac_full": MOE_SIGMOID_AUX + PP + schedule("1F1B") + [EP, "2", "--activation_checkpoint.mode", "full"],
    "moe_ep2_tp2_etp2_ac_op_global_aux": MOE_GLOBAL_AUX + [EP, "2", TP, "2", ETP, "2", "--activation_checkpoint.mode", "selective"],
    "moe_pp2_ep2_zbv_ac_full": MOE_SIGMOID_AUX + PP + schedule("ZBVZeroBubble") + [EP, "2", "--activation_checkpoint.mode", "full"],
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
    "doc_cp2_fsdp2_compile": BC + [CP, "2", *AOT_EAGER],
    "doc_moe_cp2_ep2_aux": BC + MOE_SIGMOID_AUX + [CP, "2", EP, "2"],
}

DSV3 = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
# DeepSeek-V3 (latent attention, group-limited sigmoid routing, a shared expert, multi-token prediction
# on): MLA split by heads, the tokens MTP reads ahead sharded with their positions under CP, the MTP
# modules on the last pipeline stage fed the embeddings of the tokens ahead from the first.
CASES_DSV3_2 = {
    "dsv3_tp2": DSV3 + [TP, "2"],
    "dsv3_tp2_separate_projections": DSV3 + [TP, "2", "--model.fused_projections", "false"],
    "dsv3_cp2_allgather": DSV3 + [CP, "2"],
    "dsv3_cp2_alltoall": DSV3 + [CP, "2", *ALLTOALL],
    "dsv3_pp2_1f1b": DSV3 + PP + schedule("1F1B"),
    "dsv3_pp2_interleaved1f1b": DSV3 + PP + schedule("Interleaved1F1B"),
    "dsv3_doc_cp2": DSV3 + BC + [CP, "2"],
    "dsv3_ep2_ac_selective_op": DSV3 + [EP, "2", "--activation_checkpoint.mode", "selective"],
    "dsv3_tp2_ac_full": DSV3 + [TP, "2", "--activation_checkpoint.mode", "full"],
    # Compiled attention and dense FFNs (MTP's block too); float8 on the dense linears (not the router, not
    # MLA's narrow down projections).
    "dsv3_ep2_compile": DSV3 + [EP, "2", *AOT_EAGER],
    "dsv3_fsdp2_float8": DSV3 + F8,
    # Without multi-token prediction.
    "dsv3_tp2_no_mtp": DSV3 + [TP, "2", "--model.flavor_overrides", "mtp_depth=0"],
    "dsv3_pp2_zbvzerobubble": DSV3 + PP + schedule("ZBVZeroBubble"),
    "dsv3_pp2_dualpipev": DSV3 + PP + schedule("DualPipeV"),
    # The chunked loss with multi-token prediction: each depth's loss chunked too, its labels past the window left out.
    "dsv3_fsdp2_chunked_loss": DSV3 + CHUNKED_LOSS,
    "dsv3_pp2_1f1b_chunked_loss": DSV3 + CHUNKED_LOSS + PP + schedule("1F1B"),
    "dsv3_doc_cp2_chunked_loss": DSV3 + CHUNKED_LOSS + BC + [CP, "2"],
    "dsv3_tp2_chunked_loss": DSV3 + CHUNKED_LOSS + [TP, "2"],
}
CASES_DSV3_4 = {
    "dsv3_ep2_fsdp2": DSV3 + [EP, "2"],
    "dsv3_fsdp2_tp2": DSV3 + [TP, "2"],
    "dsv3_cp2_ep2": DSV3 + [CP, "2", EP, "2"],
    "dsv3_ep2_tp2_etp2": DSV3 + [EP, "2", TP, "2", ETP, "2"],
    "dsv3_cp2_ep2_aux": DSV3 + [CP, "2", EP, "2", "--model.moe_aux_loss_coeff", "0.01"],
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
    "cp4_alltoall_no_balance", "moe_ep2_tp2_etp2_aux", "moe_ep2_tp2_etp2_ac_op_global_aux", "moe_pp2_ep2_zbv_ac_full", "moe_cp2_tp2_etp2", "moe_pp2_ep2_tp2", "moe_cp2_tp2_ep4_aux",
    "doc_cp2_fsdp2_compile", "pp2_gpipe", "tp2_ac_every_2nd_block", "moe_ep2_ac_full", "fsdp2_float8_rowwise",
    "cp2_allgather_no_balance", "moe_ep4_tp2_float8", "moe_hsdp2x2_ep2", "free_fsdp2_tp2", "moe_ep2_fsdp2_tp2",
    "fsdp2_tp2_compile_fused_projections", "moe_ep2_compile", "moe_cp2_ep4_aux", "moe_pp2_ep2_aux",
    "tp2_no_sp", "free_tp2", "tp2_no_sp_separate_projections", "fsdp2_tp2_separate_projections", "tp2_compile_fused_projections",
    "fsdp2_separate_projections_ac_selective_op", "pp2_1f1b_explicit_stages", "pp2_dualpipev", "moe_ep2_sigmoid_aux", "moe_tp2_etp2_loop",
    "moe_ep2_ac_selective_op", "doc_pp2_zbvzerobubble", "doc_cp2_alltoall_headtail", "doc_fsdp2_compile", "fsdp2_ac_selective_op", "moe_pp2_aux",
    "cp4_alltoall_headtail", "moe_ep4_aux", "pp2_tp2_1f1b", "doc_cp4_alltoall_headtail", "cp2_pp2",
    "tp2_sp_lp", "free_cp2", "doc_fsdp2", "dsv3_pp2_zbvzerobubble", "dsv3_pp2_dualpipev", "dsv3_tp2_separate_projections",
    "l4_pp2_gpipe", "l4_pp2_dualpipev", "l4_pp2_loopedbfs", "l4_pp2_interleavedzerobubble",
    "gpt_oss_doc_cp2_alltoall",
}
# Llama 4 (debugmodel: MoE every other block, NoPE block 3 and 7, L2 QK-norm, temperature tuning from
# position 7 on). seq_len 32 spans chunks: under CP 2 the head-tail shards are 4 pieces of 8 tokens,
# so a chunk of 12 crosses from rank 0's piece into rank 1's and ends inside it; one of 16 spans
# pieces of two ranks. Under CP 4 (pieces of 4) chunks of 8 leave whole KV shards unseen.
L4 = ["--model.name", "llama4", "--model.flavor", "debugmodel"]


def chunks(size: int) -> list[str]:
    return L4 + ["--model.flavor_overrides", f"attention_chunk_size={size},floor_scale=8"]


CASES_L4_2 = {
    "l4_tp2": chunks(12) + [TP, "2"],
    "l4_cp2_chunk12_allgather": chunks(12) + [CP, "2"],
    "l4_cp2_chunk16_alltoall": chunks(16) + [CP, "2", *ALLTOALL],
    "l4_cp2_chunk12_alltoall_no_balance": chunks(12) + [CP, "2", *ALLTOALL, *NO_BALANCE],
    "l4_doc_cp2": chunks(12) + BC_RESET + [CP, "2"],
    "l4_pp2_1f1b": chunks(12) + PP + schedule("1F1B"),
    "l4_pp2_interleaved1f1b": chunks(12) + PP + schedule("Interleaved1F1B"),
    "l4_ep2_ac_compile": chunks(12) + [EP, "2", "--activation_checkpoint.mode", "selective", *AOT_EAGER],
    "l4_fsdp2_float8": chunks(12) + F8,
    "l4_pp2_gpipe": chunks(12) + PP + schedule("GPipe"),
    "l4_pp2_zbvzerobubble": chunks(12) + PP + schedule("ZBVZeroBubble"),
    "l4_pp2_dualpipev": chunks(12) + PP + schedule("DualPipeV"),
    "l4_pp2_loopedbfs": chunks(12) + PP + schedule("LoopedBFS"),
    "l4_pp2_interleavedzerobubble": chunks(12) + PP + schedule("InterleavedZeroBubble"),
}
CASES_L4_4 = {
    "l4_cp4_chunk8": chunks(8) + [CP, "4"],
    "l4_ep2_fsdp2": chunks(12) + [EP, "2"],
    "l4_fsdp2_tp2": chunks(12) + [TP, "2"],
    "l4_ep2_tp2_etp2": chunks(12) + [EP, "2", TP, "2", ETP, "2"],
    "l4_cp2_tp2": chunks(12) + [CP, "2", TP, "2"],
    "l4_hsdp2x2": chunks(12) + ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"],
}
# Qwen3 dense: q/k head norms, heads wider than dim / n_heads; the tied flavor's one parameter is both
# the embedding and the output (TP splits both by vocabulary rows, FSDP holds them in one unit).
QWEN3 = ["--model.name", "qwen3", "--model.flavor", "debugmodel"]
QWEN3_TIED = ["--model.name", "qwen3", "--model.flavor", "debugmodel_tied"]
CASES_QWEN3_2 = {
    "qwen3_tied_fsdp2_chunked_loss": QWEN3_TIED + ["--training.loss_chunks", "4"],
    "qwen3_tied_tp2": QWEN3_TIED + [TP, "2"],
    "qwen3_tied_cp2": QWEN3_TIED + [CP, "2"],
    "qwen3_pp2_1f1b": QWEN3 + PP + schedule("1F1B"),
    # Qwen3-MoE's q/k head norms under TP too (their weights' gradients: sums over every rank's heads).
    "qwen3_moe_tp2": ["--model.name", "moe", "--model.flavor", "debugmoe_qwen3", TP, "2"],
}
CASES_QWEN3_4 = {
    "qwen3_tied_fsdp2_tp2": QWEN3_TIED + [TP, "2"],
}
# gpt-oss (debugmodel: sinks, biases, YaRN, top-4 of 8 clamped experts). Windows of 6 over seq_len 32
# cross chunk boundaries: under CP 2 the head-tail pieces hold 8 tokens, and each needs the last 5
# of the piece before it (another rank's, but for the middle pair).
GPT_OSS = ["--model.name", "gpt_oss", "--model.flavor", "debugmodel", "--model.flavor_overrides", "sliding_window=6"]
CASES_GPT_OSS_2 = {
    "gpt_oss_tp2": GPT_OSS + [TP, "2"],
    "gpt_oss_cp2": GPT_OSS + [CP, "2"],
    "gpt_oss_pp2_1f1b": GPT_OSS + PP + schedule("1F1B"),
    # Windows within documents: block-causal masks with positions restarting at each document.
    "gpt_oss_doc_fsdp2_compile_ac_chunked_loss": GPT_OSS + BC_RESET + [
        *AOT_EAGER, "--activation_checkpoint.mode", "selective", "--training.loss_chunks", "4"],
    "gpt_oss_doc_cp2_alltoall": GPT_OSS + BC_RESET + [CP, "2", *ALLTOALL],
    # float8 on the biased q/k/v/o (their biases added in high precision), the router left out. The
    # float8 reference runs each rank's microbatch alone (activation scales), which the global-batch
    # aux loss's counts would see: it is off here.
    "gpt_oss_fsdp2_float8": GPT_OSS + F8 + ["--model.moe_aux_loss_coeff", "0"],
}
CASES_GPT_OSS_4 = {
    "gpt_oss_fsdp2_ep2": GPT_OSS + [EP, "2"],
}
# Muon: each matrix's update on the whole matrix, gathered from its shards (Newton-Schulz in fp32
# here: bf16 would round away the differences these cases look for).
MUON = ["--optimizer.name", "Muon", "--optimizer.ns_dtype", "float32", "--optimizer.lr", "0.02"]
# QK-clip where some heads' largest logits pass the threshold from the first step and some not (the
# debug models' are 0.3 to 0.5 at the start; DeepSeek-V3's 0.15 to 0.22): each rank clips its own heads.
QK_CLIP = ["--optimizer.qk_clip_threshold", "0.4"]
CASES_MUON_2 = {
    "muon_fsdp2": MUON,
    "muon_tp2": MUON + [TP, "2", "--model.flavor", "debugmodel_gqa"],
    "muon_pp2_1f1b": MUON + PP + schedule("1F1B") + QK_CLIP,
    "muon_pp2_interleaved1f1b": MUON + PP + schedule("Interleaved1F1B"),
    "muon_cp2": MUON + [CP, "2"],
    "muon_moe_ep2": MUON + MOE + [EP, "2"],
    # MLA's weights of several projections, each orthogonalized alone; MTP's modules; Llama 4's experts.
    "muon_dsv3_fsdp2": MUON + DSV3,
    "muon_dsv3_tp2": MUON + DSV3 + [TP, "2", "--optimizer.qk_clip_threshold", "0.18"],
    "muon_l4_ep2": MUON + L4 + [EP, "2"],
}
CASES_MUON_4 = {
    "muon_fsdp2_tp2": MUON + [TP, "2", "--model.flavor", "debugmodel_gqa"] + QK_CLIP,
    "muon_hsdp2x2": MUON + ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"],
    "muon_moe_ep2_fsdp2": MUON + MOE + [EP, "2"],
}

TWO_RANKS = CASES_2 | CASES_PP2 | CASES_CP2 | CASES_MOE_2 | CASES_DOC_2 | CASES_DSV3_2 | CASES_L4_2 | CASES_QWEN3_2 | CASES_GPT_OSS_2 | CASES_MUON_2
FOUR_RANKS = CASES_4 | CASES_CP4 | CASES_MOE_4 | CASES_DOC_4 | CASES_DSV3_4 | CASES_L4_4 | CASES_QWEN3_4 | CASES_GPT_OSS_4 | CASES_MUON_4

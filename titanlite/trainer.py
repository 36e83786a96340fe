"""The Trainer: what a run holds and one optimizer step.

Trainer.__init__ builds everything in order (mesh, tokenizer, model on meta, parallelize,
materialize + init, optimizer, data, metrics); train_step is one optimizer step over the
gradient-accumulation microbatches (forward/backward, then apply_gradients), and validate one
pass over the validation set. The run loop and start-up are titanlite/train.py's.
"""

from __future__ import annotations

import itertools
import math
import os
from contextlib import ExitStack, contextmanager

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from titanlite.checkpoint.checkpointer import Checkpointer
from titanlite.config import JobConfig
from titanlite.converters import build_converters
from titanlite.data.dataset import build_dataloader
from titanlite.data.sources import token_parts
from titanlite.data.windows import MixedWindows
from titanlite.fault_tolerance import FaultTolerance
from titanlite.data.tokenizer import build_tokenizer
from titanlite.dtensors import local
from titanlite.errors import ConfigError, TrainingDiverged
from titanlite.fault_injection import FaultInjector
from titanlite.health import SpikeGuard, hosts
from titanlite.loss import IGNORED, cross_entropy_sum
from titanlite.metrics import MetricsLogger, log_line
from titanlite.models import FAMILIES, MoEArgs, build_model, model_args
from titanlite.models.common.attention import attention_kernels, document_layout
from titanlite.models.common.linear import OutputProjection
from titanlite.models.common.moe import configure_experts, global_balance, set_batch, update_expert_bias
from titanlite.optim.build import build_optimizer, check_adamw_params
from titanlite.optim.clip import clip_grad_norm_, clip_to, reduce_partial_grads
from titanlite.optim.qk_clip import qk_clip
from titanlite.optim.schedule import build_lr_scheduler
from titanlite.parallel.activation_checkpoint import check_replays_done, replays
from titanlite.parallel.context import register_cpu_ring_attention, sequence_parallel_step
from titanlite.parallel.compile import compiled_units_line
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.parallelize import assign_full_value, loss_parallel_enabled, parallelize
from titanlite.parallel.pipeline import build_schedule, forward_only, pipeline_stages
from titanlite.parallel.stage_inference import MetadataInference
from titanlite.replay import Replay
from titanlite.rollback import Batches


def set_determinism(config: JobConfig, device: torch.device) -> int:
    """[debug]: the seed (drawn on rank 0 and shared when debug.seed is none) and deterministic kernels."""
    d = config.debug
    if d.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=d.deterministic_warn_only)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    seed = d.seed
    if seed is None:
        drawn = torch.tensor(int.from_bytes(os.urandom(4), "little") >> 1, device="cpu" if device.type == "meta" else device)
        if device.type != "meta":
            dist.broadcast(drawn, src=0)
        seed = int(drawn)
        log_line(f"debug.seed is none: seed {seed} drawn at random (set debug.seed={seed} to repeat this run)")
    torch.manual_seed(seed)
    return seed


class Trainer:
    def __init__(self, config: JobConfig, device: torch.device):
        self.config, self.device = config, device
        t = config.training
        self.dims = ParallelDims.from_config(config, dist.get_world_size())
        self.dims.build_mesh("cpu" if device.type == "meta" else device.type)
        # The seed used goes into the saved config, so the config reproduces the run.
        self.seed = config.debug.seed = set_determinism(config, device)

        tokenizer_value, tokenizer_key = config.tokenizer
        self.tokenizer = build_tokenizer(tokenizer_value, tokenizer_key)
        args = model_args(
            config.model.name, config.model.flavor, self.tokenizer.vocab_size, config.longest_sequence, config.model.n_layers, config.model
        )
        self.document_masking = args.attn_mask_type == "block_causal"
        # Masks other than documents' (Llama 4's chunks) need each token's position in the window.
        self.masked_attention = args.masked_attention
        if device.type != "meta":
            args, kernels = attention_kernels(args, device, self.dims.cp_enabled)
            log_line(kernels)
        family = FAMILIES[config.model.name]
        family.check(args, self.dims)
        if config.checkpoint.enable and config.checkpoint.last_save_in_hf:
            family.check_hf_export(args)  # before training, not when rank 0 converts the last checkpoint
        self.plan = family.plan
        if self.tokenizer.vocab_size > args.vocab_size:
            raise ConfigError(
                f"{tokenizer_key}='{tokenizer_value}' has {self.tokenizer.vocab_size} tokens, more "
                f"than model.flavor='{config.model.flavor}' embeds ({args.vocab_size}); use a smaller tokenizer"
            )
        whole = build_model(config.model.name, args)
        if t.dtype == "bfloat16":
            whole.to(torch.bfloat16)  # parameters, gradients and optimizer states; RoPE is rebuilt in fp32
        self.num_params, self.active_params = whole.num_params(), args.num_params(active=True)
        self.flops_per_token = whole.flops_per_token(t.seq_len)
        if self.dims.pp_enabled:
            self.stage_ids, n_stages, self.model_parts = pipeline_stages(whole, self.plan, self.dims, config)
        else:
            self.stage_ids, n_stages, self.model_parts = [0], 1, [whole]
        self.has_first_stage, self.has_last_stage = 0 in self.stage_ids, n_stages - 1 in self.stage_ids
        self.converters = build_converters(config)
        self.moe_layers = [layer for part in self.model_parts for layer in self.plan.moe_layers(part)]
        if self.moe_layers and device.type != "meta":  # before parallelize: the kernel decides what compiles whole
            log_line(configure_experts([layer.experts for layer in self.moe_layers], args.use_grouped_mm, device))
        for part in self.model_parts:
            parallelize(part, self.plan, self.dims, config, device.type, self.converters)
            if config.model.print_after_conversion and dist.get_rank() == 0:
                print(part, flush=True)
        if config.compile.enable and "model" in config.compile.components:
            log_line(compiled_units_line(self.model_parts))
        self.replays = [replay for part in self.model_parts for replay in replays(part)]
        self.chunked_loss = t.loss_chunks > 1  # the model returns the summed loss of labels it is given
        compile_loss = config.compile.enable and "loss" in config.compile.components
        for output in (m for part in self.model_parts for m in part.modules() if isinstance(m, OutputProjection)):
            output.loss_chunks, output.compiled_loss = t.loss_chunks, compile_loss
        self.is_moe, self.aux_loss_on = isinstance(args, MoEArgs), bool(getattr(args, "aux_loss_coeff", 0))
        # Multi-token prediction (DeepSeek-V3): its depths and the weight of their mean loss.
        self.mtp_depth, self.mtp_loss_weight = getattr(args, "mtp_depth", 0), getattr(args, "mtp_loss_weight", 0.0)
        self.balance: tuple[torch.Tensor, torch.Tensor] | None = None  # the last step's MoE counts and aux loss
        self.loss_parallel = loss_parallel_enabled(self.dims, config)
        self.cross_entropy = torch.compile(cross_entropy_sum) if compile_loss else cross_entropy_sum
        if self.dims.cp_enabled and device.type == "cpu":
            register_cpu_ring_attention()
        self.ft = None  # torchft's replica groups (fault_tolerance.enable), built with the optimizers
        if device.type == "meta":
            return  # dry run: nothing to materialize
        offload = t.enable_cpu_offload and device.type == "cuda"
        for part in self.model_parts:
            # FSDP's CPU offload keeps the sharded parameters in host memory; buffers (RoPE) live on the GPU.
            part.to_empty(device="cpu" if offload else device)
            part.init_weights(self.seed, assign=assign_full_value)
            if offload:
                for module in part.modules():
                    module._buffers.update({k: v.to(device) for k, v in module._buffers.items() if v is not None})
            part.train()
        self.loss_scale = 1  # the global token count of the current step
        self.mtp_loss = torch.zeros((), device=device)  # this rank's part of the step's MTP loss
        self.first_nonfinite_step = torch.full((), -1, device=device)  # -1: every grad norm so far is finite
        self.pp_schedule = None
        if self.dims.pp_enabled:
            self.pp_schedule = build_schedule(config, self.model_parts, self.stage_ids, n_stages, self.dims, device, self.loss_fn)
        self.pp_group = self.dims.get_mesh("pp").get_group() if self.dims.pp_enabled else None

        # One optimizer and lr schedule per model part (pipeline stage): checkpoints key the optimizer
        # state by parameter name through the module that owns the parameters.
        components = self.plan.matrix_components(self.model_parts[0].args)
        self.optimizers = [build_optimizer(part.named_parameters(), config, components) for part in self.model_parts]
        if config.optimizer.name == "Muon":
            check_adamw_params(config, self.model_parts, device)
            for opt, part in zip(self.optimizers, self.model_parts):
                opt.qk_clip = qk_clip(config, part, self.plan, self.dims)
        self.lr_schedulers = [build_lr_scheduler(opt, config) for opt in self.optimizers]

        batch_mesh = self.dims.get_mesh("batch")
        self.dp_rank, self.dp_degree = batch_mesh.get_local_rank(), batch_mesh.size()
        self.batch_group, self.loss_group = batch_mesh.get_group(), self.dims.get_mesh("loss").get_group()
        self.routing_group = self.dims.get_mesh("routing").get_group()  # MoE token counts: tp ranks route their own
        self.accumulation_steps = self.dims.accumulation_steps(t.local_batch_size, t.global_batch_size)
        pipeline_forwards = t.local_batch_size // config.parallelism.pipeline_parallel_microbatch_size if self.dims.pp_enabled else 1
        set_batch(self.moe_layers, self.accumulation_steps * t.local_batch_size * self.dp_degree, t.seq_len,
                  self.accumulation_steps * pipeline_forwards)
        self.ft = FaultTolerance(config, self) if config.fault_tolerance.enable else None
        loader_rank, loader_ranks = self.ft.data_position(self.dp_rank, self.dp_degree) if self.ft else (self.dp_rank, self.dp_degree)
        self.dataloader = build_dataloader(config, self.tokenizer, loader_rank, loader_ranks)
        self.step, self.tokens_seen, self.skipped_steps = 0, 0, 0
        self.samples_read = 0  # of token files, all ranks': where their loader goes on after a resume
        self.metrics = MetricsLogger(
            config,
            device,
            self.flops_per_token,
            tokens_divisor=self.dims.non_data_parallel_size,
            rank=dist.get_rank(),
        )
        self.checkpointer = Checkpointer(config, self)
        self.profiler = None
        self.hosts = hosts()  # every rank's, for the health checks' messages
        replay = Replay(config, device, self.metrics, self.hosts) if config.health.replay else None
        self.spikes = SpikeGuard(config, self.metrics, self.hosts, replay) if config.health.spike_policy != "off" else None
        self.batches = Batches(config)  # drawn so far, and those skipped (health.skip_batches, rollbacks)
        self.injector = FaultInjector(config, dist.get_rank())

    def parameters(self):
        return [p for part in self.model_parts for p in part.parameters()]

    def token_inputs(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's per-token keyword inputs (every pipeline stage gets them), from the whole
        window: under block_causal each token's document id and position; under context parallel
        or a masked attention its position (which RoPE rows its sequence shard takes, which chunk
        it is in); with multi-token prediction the tokens 1..depth ahead of each."""
        token_inputs = {}
        if self.document_masking:
            document_ids, positions = document_layout(
                inputs, self.tokenizer.bos_id, self.config.model.reset_position_ids, self.tokenizer.eos_id
            )
            token_inputs = {"positions": positions, "document_ids": document_ids}
        elif self.dims.cp_enabled or self.masked_attention:
            token_inputs = {"positions": torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)}
        if self.mtp_depth:
            # Token i+k is label i+k-1; past the window's end any token will do (its predictions are IGNORED).
            token_inputs["future_tokens"] = torch.stack([shifted(labels, k - 1, 0) for k in range(1, self.mtp_depth + 1)], dim=-1)
        return token_inputs

    def targets(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The labels, and with multi-token prediction (b, s, 1 + depth): depth k predicts label i+k,
        IGNORED past the window's end, and under document masks where that token lies in another
        document than position i (as Megatron's MTP does on packed sequences)."""
        if not self.mtp_depth:
            return labels
        depths = [shifted(labels, k, IGNORED) for k in range(self.mtp_depth + 1)]
        if self.document_masking:
            window = torch.cat([inputs, labels[:, -1:]], dim=1)
            documents = document_layout(window, self.tokenizer.bos_id, False, self.tokenizer.eos_id)[0]
            for k in range(1, self.mtp_depth + 1):
                elsewhere = shifted(documents[:, 1:], k, -1) != documents[:, :-1]  # the document of token i+k+1
                depths[k] = depths[k].masked_fill(elsewhere, IGNORED)
        return torch.stack(depths, dim=-1)

    @contextmanager
    def step_context(self, inputs: torch.Tensor, labels: torch.Tensor):
        """Yields (inputs, targets, the model's per-token keyword inputs); under CP this rank's sequence
        shards of them. Loss parallel under TP."""
        token_inputs = self.token_inputs(inputs, labels)
        labels = self.targets(inputs, labels)
        with ExitStack() as stack:
            if self.loss_parallel:
                stack.enter_context(loss_parallel())
            if self.dims.cp_enabled:
                p = self.config.parallelism
                inputs, labels, *shards = stack.enter_context(
                    sequence_parallel_step(
                        self.dims.get_mesh("cp"),
                        [inputs, labels, *token_inputs.values()],
                        load_balance=p.context_parallel_load_balancer == "headtail",
                        rotate_method=p.context_parallel_rotate_method,
                    )
                )
                token_inputs = dict(zip(token_inputs, shards))
            yield inputs, labels, token_inputs | ({"labels": labels} if self.chunked_loss else {})

    def loss_fn(self, output, labels: torch.Tensor) -> torch.Tensor:
        """The summed cross entropy over the global token count. With multi-token prediction (labels:
        the targets of each depth too) a model in training returns the logits of each depth as well:
        plus mtp_loss_weight x the depths' mean loss (DeepSeek-V3's L_MTP: each depth's over all the
        window's tokens); in evaluation it returns its own logits alone."""
        if self.mtp_depth:
            labels, depth_labels = labels[..., 0], labels[..., 1:]
        if not isinstance(output, tuple):  # chunked: the model's own loss, summed (OutputProjection)
            own = output if self.chunked_loss else local(self.cross_entropy(output, labels))
            return own / self.loss_scale
        if self.chunked_loss:  # each depth's summed loss, IGNORED labels left out
            own, *depths = output
        else:
            logits, *predictions = output
            own = local(self.cross_entropy(logits, labels))
            depths = [local(self.cross_entropy(p, depth_labels[..., k], masked=True)) for k, p in enumerate(predictions)]
        mtp = sum(depths) / len(depths)
        if not MetadataInference.running:  # a pipeline stage's shape inference: its outputs are no batch's
            self.mtp_loss += mtp.detach() / self.loss_scale
        return (own + self.mtp_loss_weight * mtp) / self.loss_scale

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor, backward: bool) -> torch.Tensor:
        """Loss of one microbatch (its part of the global mean; 0 on pipeline ranks without the last
        stage), with gradients accumulated when `backward`."""
        with self.step_context(inputs, labels) as (inputs, labels, token_inputs):
            if self.pp_schedule is None:
                loss = self.loss_fn(self.model_parts[0](inputs, **token_inputs), labels)
                if backward:
                    loss.backward()
                return loss.detach()
            # Every pp rank loads the same batch: the first stage takes the inputs, the last the labels.
            args = (inputs,) if self.has_first_stage else ()
            losses = [] if self.has_last_stage else None
            target = labels if self.has_last_stage else None
            # return_outputs=False: the last stage keeps no microbatch's logits past its loss.
            if backward:
                self.pp_schedule.step(*args, target=target, losses=losses, return_outputs=False, **token_inputs)
            else:
                with forward_only(self.pp_schedule):
                    self.pp_schedule.eval(*args, target=target, losses=losses, return_outputs=False, **token_inputs)
            return torch.stack(losses).sum().detach() if losses else torch.zeros((), device=self.device)

    def train_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over the microbatches. Returns (this rank's part of the global mean loss,
        grad norm), both on the device: nothing here waits for the device."""
        if self.ft:
            self.ft.start_step()  # the replica groups' quorum, while the forward runs
        self.microbatches = microbatches  # health.replay runs them again
        loss = self.compute_gradients(microbatches)
        self.injector.after_backward(self.step, self.parameters())
        return loss, self.apply_gradients(loss)

    def compute_gradients(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]], backward: bool = True) -> torch.Tensor:
        """Forward (and backward) every microbatch; returns this rank's part of the global mean loss (on
        the device; `global_loss` sums the parts)."""
        # Dividing each rank's summed loss by the global token count makes the summed gradients
        # the gradient of the global mean, whatever the dp degree and accumulation steps.
        self.loss_scale = sum(self.global_tokens(labels) for _, labels in microbatches)
        self.mtp_loss.zero_()
        self.before_step()
        objective = sum(self.forward(x, y, backward) for x, y in microbatches)
        check_replays_done(self.replays)
        # The model's own loss (step_extras logs MTP's).
        return objective - self.mtp_loss_weight * self.mtp_loss if self.mtp_depth else objective

    def global_tokens(self, labels: torch.Tensor) -> int:
        """The tokens of `labels` on every data-parallel rank together (before any sequence split): every
        label counts (the loader packs full windows, no padding) and every rank holds as many, so each
        rank knows the count without a collective."""
        return labels.numel() * self.dp_degree

    def global_loss(self, loss: torch.Tensor) -> float:
        """The global mean loss from every rank's part (a collective, and a wait for the device: log steps only)."""
        return self.reduce_loss(loss.clone()).item()

    def before_step(self) -> None:
        for converter in self.converters:
            converter.before_step(self.model_parts)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks that hold parts of the loss: data/context ranks, and the last pp stage."""
        dist.all_reduce(loss, group=self.loss_group)
        if self.pp_group is not None:
            dist.all_reduce(loss, group=self.pp_group)  # only the last stage's rank adds a nonzero
        return loss

    def apply_gradients(self, loss: torch.Tensor | None = None) -> torch.Tensor:
        """Clip, step the optimizer and the lr schedule, clear gradients; returns the grad norm (on the
        device). A grad norm that is not finite is kept as the step's number on the device, and
        `check_finite` (log and checkpoint steps) stops the run there. With training.skip_nonfinite_steps
        the step is skipped instead, as is a spike of the loss or grad norm (health.spike_policy = skip):
        both need the values on the host, one wait for the device a step."""
        params = self.parameters()
        reduce_partial_grads(params)
        self.balance = self.expert_balance() if self.is_moe else None
        if self.ft:
            self.ft.sync_gradients(params)
        grad_norm = clip_grad_norm_(params, 0, self.pp_group)  # the norm; clipped below, after the checks read the gradients
        # False: a replica group failed in this step (fault tolerance); nothing of it counts, it is redone.
        commit = self.ft.should_commit() if self.ft else True
        spike = commit and self.spikes is not None and self.spikes.skips(self, loss, grad_norm)  # a replay may redo the step
        finite = torch.isfinite(grad_norm)
        skip = commit and (self.config.training.skip_nonfinite_steps and not bool(finite) or spike)
        clip_to(params, self.config.training.max_norm, grad_norm)
        for opt, scheduler in zip(self.optimizers, self.lr_schedulers):
            if commit and not skip:
                opt.step()
                scheduler.step()
            elif getattr(opt, "qk_clip", None):
                opt.qk_clip.reset()  # the skipped batch's logits do not count
            opt.zero_grad(set_to_none=True)
        if self.balance is not None:
            self.move_expert_bias(finite, commit and not skip)
        if skip:
            self.skip_step(f"{self.spikes.cause} at step {self.step}" if spike else f"grad norm is {grad_norm.item()} at step {self.step}")
        elif commit:
            self.first_nonfinite_step.masked_fill_(~finite & (self.first_nonfinite_step < 0), self.step)
        return grad_norm

    def check_finite(self, loss: float = 0.0) -> None:
        """Stop the run if a step's grad norm was not finite (reads the device's flag: a wait), or the
        logged `loss` is not."""
        if not math.isfinite(loss):
            raise TrainingDiverged(
                f"loss is {loss} at step {self.step}; training stopped. Lower optimizer.lr, raise "
                "lr_scheduler.warmup_steps or check the data"
            )
        step = int(self.first_nonfinite_step)
        if step >= 0:
            raise TrainingDiverged(
                f"grad norm is not finite at step {step}; training stopped at step {self.step}, before logging "
                "or saving. Lower optimizer.lr or training.max_norm, check the data, or set "
                "training.skip_nonfinite_steps=true to skip such steps"
            )

    def expert_balance(self) -> tuple[torch.Tensor, torch.Tensor]:
        """MoE: the step's tokens per expert and aux loss, summed over the ranks that routed different
        tokens (one all-reduce) and, with fault tolerance, over the replica groups, before the commit
        vote so that every group reduces alike. They stay on the device for the log."""
        counts, aux = global_balance(self.moe_layers, self.routing_group)
        if self.ft:
            counts = self.ft.sum_over_groups(counts)
        return counts, aux

    def move_expert_bias(self, finite: torch.Tensor, commit: bool) -> None:
        """By the step's counts (self.balance); the bias stays put after a step whose grad norm is not
        finite or that did not commit (zero counts); the counts start again from zero either way."""
        update_expert_bias(self.moe_layers, self.balance[0] * (finite.to(self.balance[0].device) & commit))

    def skip_step(self, where: str) -> None:
        """A step whose gradients are not finite or spiked: the optimizer and lr schedule did not move."""
        t = self.config.training
        self.skipped_steps += 1
        log_line(f"{where}: optimizer step skipped ({self.skipped_steps} skipped so far)")
        if self.skipped_steps > t.max_skipped_steps:
            raise TrainingDiverged(
                f"{where}: {self.skipped_steps} steps skipped, more than training.max_skipped_steps="
                f"{t.max_skipped_steps}; training stopped. Lower optimizer.lr or check the data"
            )

    def next_microbatches(self, data_iter) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batches = [next(data_iter) for _ in range(self.accumulation_steps)]
        if isinstance(self.dataloader.dataset, MixedWindows):  # every rank's rows: the position in the global order
            self.samples_read += len(batches) * self.dataloader.dataset.batch * self.dataloader.dataset.ranks
        return [(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)) for x, y in batches]

    def validate(self) -> dict[str, float]:
        """{"": the validation loss}; with validation.dataset_mixture also each source's loss by its name,
        and "" their mean under the mixture's weights."""
        v = self.config.validation
        if not v.dataset_mixture:
            return {"": self.evaluate(build_dataloader(self.config, self.tokenizer, self.dp_rank, self.dp_degree, "validation"))}
        parts = [part for part, _ in token_parts(self.config, "validation")]
        losses = {
            part.name: self.evaluate(build_dataloader(self.config, self.tokenizer, self.dp_rank, self.dp_degree, "validation", i))
            for i, part in enumerate(parts)
        }
        return {"": sum(float(part.weight) * losses[part.name] for part in parts)} | losses

    def source_tokens(self) -> dict[str, int]:
        """Tokens seen per source of training.dataset_mixture, from its schedule (no collective)."""
        windows, seq_len = self.dataloader.dataset, self.config.training.seq_len
        if not self.config.training.dataset_mixture:
            return {}
        counts = windows.samples_per_source(self.samples_read)
        return {f"tokens_seen_{source.stream.name}": int(n) * seq_len for source, n in zip(windows.sources, counts)}

    @torch.no_grad()
    def evaluate(self, loader) -> float:
        v = self.config.validation
        self.before_step()
        for part in self.model_parts:
            part.eval()
        self.loss_scale = 1  # summed losses
        loss_sum, tokens = torch.zeros((), device=self.device), 0
        batches = iter(loader)
        for _ in itertools.count() if v.steps == -1 else range(v.steps):
            batch = next(batches, None)
            # Data-parallel ranks read different documents and can run out at different batches:
            # all stop at the first batch that one of them lacks, or their collectives would hang.
            if not self.every_rank(batch is not None):
                break
            x, y = (b.to(self.device) for b in batch)
            loss_sum += self.forward(x, y, backward=False).float()
            tokens += self.global_tokens(y)
        loss_sum = self.reduce_loss(loss_sum)
        for part in self.model_parts:
            part.train()
        if tokens == 0:
            raise ConfigError("validation data yielded no full sequence; use a larger validation set or shorter seq_len")
        return (loss_sum / tokens).item()

    def step_extras(self) -> dict[str, float] | None:
        """What a log step shows beyond the loss: a MoE's balance, the MTP loss. Collective: every rank calls it."""
        extras = (self.stage_balance() or {}) | (self.ft.metrics() if self.ft else {}) | self.source_tokens()
        if self.mtp_depth:
            extras["mtp_loss"] = self.global_loss(self.mtp_loss)
        return extras or None

    def stage_balance(self) -> dict[str, float] | None:
        """A MoE's balance at a log step: the busiest expert's tokens over the mean in the worst layer
        of any pipeline stage (each holds its own layers, maybe none), and the summed aux loss (when
        on). Collective over pp: every rank calls it."""
        if not self.is_moe:
            return None
        load, aux = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
        if self.balance is not None and self.balance[0].numel():
            counts = self.balance[0]
            load = (counts.max(dim=1).values / counts.mean(dim=1)).max().float().to(self.device)
            aux = self.balance[1].float().to(self.device)
        if self.pp_group is not None:
            dist.all_reduce(load, op=dist.ReduceOp.MAX, group=self.pp_group)
            dist.all_reduce(aux, group=self.pp_group)
        return {"moe_max_load": load.item()} | ({"moe_aux_loss": aux.item()} if self.aux_loss_on else {})

    def every_rank(self, condition: bool) -> bool:
        flag = torch.tensor(float(condition), device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())


def shifted(labels: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """(b, s) labels moved k positions left (position i holds label i+k), `fill` past the end."""
    out = labels.new_full(labels.shape, fill)
    out[:, : labels.shape[1] - k] = labels[:, k:]
    return out

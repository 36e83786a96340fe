"""MuonClip's QK-clip (Kimi K2), `optimizer.qk_clip_threshold` = tau: after each Muon step, every
attention head whose largest logit in the step passed tau is scaled back by gamma = tau / that logit,
through the rows of the weights that make its queries and keys (the family names them:
ParallelPlan.qk_clip_rows), so that each of its logits shrinks by gamma:
- MHA (Kimi's rule): the head's query rows and key rows by sqrt(gamma) each.
- MLA (Kimi's rule): each head's plain query and key rows by sqrt(gamma), its rotary query rows by
  gamma; the rotary key all heads share and the value rows are left alone.
- GQA, per key/value group as Megatron does (a choice: the key is shared, so one head alone cannot be
  scaled): gamma from the largest logit of the group's query heads, all of them and the key by sqrt(gamma).
A QK-norm after the projections (Qwen3's) undoes any such scaling: refused, as is a family without a rule.

The attention core reports each head's largest logit (attention.largest_logits, exact: computed apart
in fp32). Data-parallel ranks, which see other tokens, take the max over one another; tensor
parallel's ranks each clip their own heads, pipeline stages their own blocks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from titanlite.errors import ConfigError
from titanlite.dtensors import local
from titanlite.optim.owners import local_piece


class QKClip:
    def __init__(self, model: nn.Module, rule: tuple[int, dict], threshold: float, *, group=None, tp_rank: int = 0, tp: int = 1):
        """`rule`: the family's (key/value groups, {weight name within an attention module: (row groups,
        [(rows, power of gamma), ...])}); `group`: the ranks to take the max over (None: this process alone)."""
        self.threshold, self.group = threshold, group
        self.kv_heads, self.rows = rule
        self.heads = model.args.n_heads
        self.clipped = 0  # key/value groups scaled back so far, on this rank's heads
        self.local_heads, self.first_head = self.heads // tp, tp_rank * self.heads // tp
        # The attention modules around a core that reports its logits (models/common/attention.py's CoreAttention)
        self.attentions = [m for m in model.modules() if hasattr(getattr(m, "inner_attention", None), "max_logits")]
        device = next(model.parameters()).device
        for attention in self.attentions:
            attention.inner_attention.max_logits = torch.full((self.local_heads,), -torch.inf, device=device)

    @torch.no_grad()
    def clip(self) -> None:
        """Scale back each head (key/value group) whose largest logit since the last call passed the threshold."""
        if not self.attentions:
            return
        cores = [a.inner_attention for a in self.attentions]
        logits = torch.stack([core.max_logits for core in cores])  # (attention modules, local heads)
        if self.group is not None:
            dist.all_reduce(logits, op=dist.ReduceOp.MAX, group=self.group)
        group_size = self.heads // self.kv_heads
        largest = logits.view(len(cores), -1, group_size).amax(dim=2)
        # Only a group whose largest logit passed tau (never one that saw nothing, -inf, nor a NaN)
        gammas = torch.where(largest > self.threshold, self.threshold / largest, torch.ones_like(largest))
        self.reset()
        for attention, mine, clipped in zip(self.attentions, gammas.repeat_interleave(group_size, dim=1), (gammas < 1).sum(dim=1).tolist()):
            if clipped:
                self.clipped += clipped
                gamma = torch.ones(self.heads, device=mine.device)
                gamma[self.first_head:self.first_head + self.local_heads] = mine  # the other tp ranks' heads are theirs
                self.scale(attention, gamma)

    def reset(self) -> None:
        """The next step starts afresh (also after a step whose update was skipped: its logits do not count)."""
        for attention in self.attentions:
            attention.inner_attention.max_logits.fill_(-torch.inf)

    def scale(self, attention: nn.Module, gamma: torch.Tensor) -> None:
        for name, (groups, blocks) in self.rows.items():
            try:
                weight = attention.get_parameter(name)
            except AttributeError:
                continue  # the family's other variant (MLA's wq or its wq_a/wq_b)
            per_group = gamma[torch.arange(groups, device=gamma.device) * self.heads // groups]  # row group g: head g*H/G's
            mine = local(weight)
            factors = torch.cat([per_group[:, None].to(mine.dtype) ** power * mine.new_ones(1, rows) for rows, power in blocks], dim=1)
            whole = factors.reshape(-1, 1).expand(weight.shape)
            piece = local_piece(weight, whole)
            mine.mul_(piece)


def qk_clip(config, model: nn.Module, plan, dims) -> QKClip | None:
    """The run's QK-clip on one model part, or None (optimizer.qk_clip_threshold = 0); ConfigError
    where the model's attention cannot be clipped."""
    threshold = config.optimizer.qk_clip_threshold
    if not threshold:
        return None
    args = model.args
    if plan.qk_clip_rows is None or getattr(args, "qk_norm", False):
        why = "its q/k head norms undo any scaling of the projections" if getattr(args, "qk_norm", False) else \
            "the family has no QK-clip rule"
        raise ConfigError(
            f"optimizer.qk_clip_threshold={threshold} with model {config.model.name} flavor {config.model.flavor}: {why}; "
            "set optimizer.qk_clip_threshold = 0 or use a llama3, deepseek_v3 or moe flavor without qk_norm"
        )
    tp_rank = dims.get_mesh("tp").get_local_rank() if dims.tp > 1 else 0
    return QKClip(model, plan.qk_clip_rows(args), threshold, group=dims.get_mesh("loss").get_group(), tp_rank=tp_rank, tp=dims.tp)

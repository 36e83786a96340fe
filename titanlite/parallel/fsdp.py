"""FSDP2 (`fully_shard`) per transformer block, the embedding, [final norm + output] and the root.

One mesh dim shards (FSDP), two dims replicate-and-shard (HSDP); a replicate dim with shard size 1
is plain data parallel (DDP). The loss is divided by the global count of valid tokens, so FSDP's
own averaging over ranks is turned off (gradient divide factor 1): gradients are summed.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    reshard_output_after_forward: bool,
    cpu_offload: bool = False,
) -> None:
    shard = dict(
        mesh=dp_mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    )
    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, reshard_after_forward=reshard_after_forward, **shard)
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=reshard_after_forward, **shard)
    # The output is used again right at the start of backward: by default keep it gathered.
    tail = [m for m in (model.norm, model.output) if m is not None]
    if tail:
        fully_shard(tail, reshard_after_forward=reshard_output_after_forward, **shard)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **shard)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM (no pre-multiplied sum): same result, and gloo has no PREMUL_SUM.
            module.set_force_sum_reduction_for_comms(True)

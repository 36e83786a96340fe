"""The mixture-of-experts family's model: Llama 3's transformer with MoE feed-forwards (the layer:
models/common/moe.py) in blocks from `n_dense_layers` on."""

from __future__ import annotations

from torch import nn

from titanlite.models.common.moe import MoE
from titanlite.models.llama3.model import Transformer, TransformerBlock
from titanlite.models.common.args import MoEArgs


class MoETransformer(Transformer):
    """Llama's transformer with MoE feed-forwards from block `n_dense_layers` on."""

    def make_block(self, layer_id: int, args: MoEArgs) -> nn.Module:
        return TransformerBlock(layer_id, args, MoE(args) if args.is_moe(layer_id) else None)

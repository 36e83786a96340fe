"""A model family: what generic code takes from a model, so that titanlite/parallel/ and
titanlite/config/ name none of its modules (in the spirit of TorchTitan's TrainSpec, smaller).

`ModelFamily` is torch-free (the config and run_train.sh's checks read the flavors and the
family's checks); its `plan` names the module whose `PLAN` (a `ParallelPlan`) holds the torch side.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

from titanlite.models.common.args import ModelArgs


@dataclass(frozen=True)
class ModelFamily:
    name: str
    flavors: dict[str, ModelArgs]
    check: Callable[[ModelArgs, object], None]  # the shapes against the layout (ParallelDims); ConfigError
    check_config: Callable[[object, ModelArgs], None]  # the config's [model] section and the shapes it gives; ConfigError
    plan_module: str  # where PLAN lives
    check_hf_export: Callable[[ModelArgs], None] = lambda args: None  # a Hugging Face architecture to export to
    hf_model_type: str | None = None  # config.json's model_type of that architecture (its mapping: plan.hf)

    @property
    def plan(self) -> "ParallelPlan":
        return importlib.import_module(self.plan_module).PLAN


@dataclass(frozen=True)
class ParallelPlan:
    """The torch side of a family. Modules by name: `head` (before the blocks: the first pipeline
    stage holds them; one FSDP unit each), `blocks` (the ModuleDict of repeated blocks: one FSDP,
    AC and compile unit each, spread over pipeline stages), `tail` (after them: the last stage; one
    FSDP unit together). A stage is the whole model with the modules it does not hold removed."""

    build: Callable  # ModelArgs -> nn.Module (called on the meta device)
    head: tuple[str, ...]
    blocks: str
    tail: tuple[str, ...]
    tp_plan: Callable  # (model, sequence_parallel, loss_parallel) -> {name: ParallelStyle} of head and tail
    block_tp_plan: Callable  # (block, sequence_parallel, float8_recipe or None) -> {name: ParallelStyle}
    compile_units: Callable  # (block, tp_enabled) -> the modules torch.compile wraps
    # The family's Hugging Face mapping (models/<family>/hf.py): save_hf, iter_hf(folder, read), check_hf_shapes, and
    # optionally OPTIONAL, prefixes of weights a Hugging Face file may lack (they keep their initialization).
    hf: ModuleType | None
    # Mixture of experts: the routed-expert modules (expert parallel shards them over experts, FSDP
    # over the data ranks outside EP) and the layers whose load balance the trainer updates.
    experts: Callable = lambda model: []  # model -> [nn.Module]
    moe_layers: Callable = lambda model: []  # model -> [titanlite.models.moe.MoE]
    expert_hidden_dims: dict = field(default_factory=dict)  # experts' parameter -> the dim expert TP splits
    float8_excluded: tuple[str, ...] = ()  # module names whose linears float8 leaves in high precision
    tail_on_one_stage: bool = False  # the tail's modules read one another's inputs (multi-token prediction)
    # Blocks outside `blocks` (DeepSeek's MTP blocks, in the tail), as (parent module, attribute): activation
    # checkpointing and compile treat them as blocks.
    blocks_elsewhere: Callable = lambda model: []
    # Weights that hold several projections row-wise (MLA's latent and rotary key in one), as a name
    # suffix -> (groups, row sizes): rows are `groups` repeats of blocks of those sizes, and Muon
    # orthogonalizes each block's rows across the groups as its own matrix (args -> that dict).
    matrix_components: Callable = lambda args: {}
    # QK-clip's rule (optim/qk_clip.py): args -> (key/value groups, {weight name within an attention module:
    # (row groups, [(rows, power of gamma), ...])}): which rows make each head's queries and keys. None: no rule.
    qk_clip_rows: Callable | None = None

"""The model-family protocol: titanlite/parallel/ takes every module name from the family's plan, so
a family whose modules are named nothing like Llama's is split, checkpointed and sharded the same."""

import pytest

from distributed import run_distributed


def toy_plan():
    from torch import nn

    from titanlite.models.family import ParallelPlan

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.stack = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for i in range(3)})
            self.final = nn.Linear(8, 16)

        def forward(self, tokens):
            h = self.embed(tokens) if self.embed is not None else tokens
            for block in self.stack.values():
                h = block(h)
            return self.final(h) if self.final is not None else h

    return ParallelPlan(
        build=Toy, head=("embed",), blocks="stack", tail=("final",), tp_plan=lambda model, sp, lp: {},
        block_tp_plan=lambda block, sp, float8: {}, compile_units=lambda block, tp: [block],
        hf=None,
    )


def test_pipeline_split_takes_the_family_module_names():
    from titanlite.config import parse_args
    from titanlite.parallel.pipeline import split_model, stage_module_names

    plan = toy_plan()
    stages = stage_module_names(parse_args([]), plan, 3, 2, False)
    assert stages == [["embed", "stack.0", "stack.1"], ["stack.2", "final"]]
    second = split_model(plan.build(), plan, stages[1])
    assert second.embed is None and list(second.stack) == ["2"] and second.final is not None


def _toy_fsdp_with_ac() -> tuple:
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from titanlite.config import parse_args
    from titanlite.parallel.dims import ParallelDims
    from titanlite.parallel.parallelize import parallelize

    plan = toy_plan()
    config = parse_args(["--activation_checkpoint.mode", "full", "--training.mixed_precision_param", "float32"])
    dims = ParallelDims.from_config(config, 2)
    dims.build_mesh("cpu")
    model = plan.build()
    parallelize(model, plan, dims, config, "cpu")
    model(torch.randint(0, 16, (2, 4))).sum().backward()
    units = sorted(name for name, m in model.named_modules() if isinstance(m, FSDPModule))
    sharded = all(isinstance(p, DTensor) and p.grad is not None for p in model.parameters())
    names = {id(m): name for name, m in model.named_modules()}
    prefetch = {names[id(m)]: [names[id(s._modules[0])] for s in m._get_fsdp_state()._states_to_forward_prefetch]
                for m in model.modules() if isinstance(m, FSDPModule)}
    return units, sharded, prefetch


@pytest.mark.slow
def test_fsdp_and_activation_checkpointing_take_the_family_units():
    units, sharded, prefetch = run_distributed(_toy_fsdp_with_ac, 2, timeout=120)[0]
    # Head, each block (wrapped for AC), the tail, the root: from the plan's names alone.
    assert units == ["", "embed", "final", "stack.0", "stack.1", "stack.2"] and sharded
    # In forward each unit starts the next one's all-gather.
    assert prefetch == {"": [], "embed": ["stack.0"], "stack.0": ["stack.1"], "stack.1": ["stack.2"], "stack.2": ["final"],
                        "final": []}

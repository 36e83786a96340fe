"""A training step that does not log never waits for the device: no value goes to the host.

Every Tensor method that hands a value to Python (and so, on a GPU, waits for the kernels queued
before it) is wrapped for the whole run, and each call is booked to the step the loop is in. Log
steps read the loss and grad norm; the steps between them must read nothing. Real Trainers on gloo
ranks, as in training; the CPU has no queue to wait on, but the calls are the same as on a GPU.

Two reads are allowed, and named: torch's DeviceMesh reads its rank grid, a host tensor by design
(context parallel builds sub-meshes each step), and expert parallel's all-to-all needs each rank's
token counts on the host to size its buffers (dropless routing; TorchTitan's reads them too).
"""

from __future__ import annotations

import sys
from collections import defaultdict

import pytest
import torch

from distributed import run_distributed
from helpers import tiny_args

pytestmark = pytest.mark.slow

HOST_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")
ALLOWED = {"mesh": "torch/distributed/device_mesh.py", "ep": "titanlite/parallel/expert.py"}


def _syncs_per_step(dataset: str, folder: str, overrides: list[str]) -> dict:
    from titanlite.config import parse_args
    from titanlite.train import Trainer

    trainer = Trainer(parse_args(tiny_args(dataset, folder, "--training.steps", "6", "--metrics.log_freq", "3", *overrides)),
                      torch.device("cpu"))
    calls = defaultdict(list)
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name, method):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1)  # the code that asked for the value
            where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
            calls[trainer.step].append(next((key for key, path in ALLOWED.items() if path in where), f"{name} at {where}"))
            return method(self, *args, **kwargs)
        return read

    for name, method in originals.items():
        setattr(torch.Tensor, name, counted(name, method))
    try:
        trainer.train()
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
    return {step: calls[step] for step in range(1, 7)}


MOE = ["--model.name", "moe", "--model.flavor", "debugmoe"]


@pytest.mark.parametrize("world, overrides, allowed", [
    (1, [], set()),
    (2, ["--parallelism.data_parallel_shard_degree", "2"], set()),
    (2, ["--parallelism.tensor_parallel_degree", "2"], set()),
    (4, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"], set()),
    pytest.param(2, ["--parallelism.pipeline_parallel_degree", "2", "--training.global_batch_size", "4",
                     "--parallelism.pipeline_parallel_microbatch_size", "1"], set(), marks=pytest.mark.full),
    pytest.param(2, ["--parallelism.context_parallel_degree", "2"], {"mesh"}, marks=pytest.mark.full),
    pytest.param(2, [*MOE, "--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2"],
                 {"ep"}, marks=pytest.mark.full),
], ids=["one_rank", "fsdp2", "tp2", "fsdp2_tp2", "pp2", "cp2", "moe_ep2"])
def test_steps_that_do_not_log_read_nothing_from_the_device(corpus_jsonl, tmp_path, world, overrides, allowed):
    for rank, per_step in enumerate(run_distributed(_syncs_per_step, world, str(corpus_jsonl), str(tmp_path), overrides)):
        assert per_step[1] and per_step[3] and per_step[6], per_step  # log steps read the loss and grad norm
        for step in (2, 4, 5):
            assert set(per_step[step]) <= allowed, f"rank {rank}, step {step}: {per_step[step]}"
            assert not allowed or per_step[step], f"rank {rank}, step {step}: the allowed reads did not happen"

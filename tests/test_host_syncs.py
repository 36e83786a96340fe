"""A training step that does not log never waits for the device: no value goes to the host.

Real Trainers on gloo ranks run 6 steps under `host_reads.HostReads`, which books every host read
of device memory to the step the loop is in and to the line that asked for it:
- at torch's dispatcher (a TorchDispatchMode), whoever calls: item/float/bool (_local_scalar_dense),
  equal, allclose, and ops whose output size depends on the data (nonzero, unique, bincount,
  masked_select, boolean-mask indexing, repeat_interleave without output_size);
- at the Python methods that never reach it: tolist, numpy;
- host transfers: on CPU device and host are one memory, so a device->host copy cannot be told
  from the tensors. `.cpu()`, `.to()` to the CPU and `copy_` count when titanlite's own code calls
  them (titanlite moves step data to the host only to log); torch's own calls (FSDP's and the
  optimizer's many device->device copy_) do not, and their reads still show at the dispatcher.
Compiled regions compile and run as compiled: the mode sets ignore_compile_internals, without
which Dynamo skips every frame under a dispatch mode (the blocks' fullgraph compile then fails the
run: "found no compiled frames"); ops outside the graphs are checked.
The CPU has no queue to wait on, but the calls are those of a GPU run.

Log steps (1, 3, 6) read the loss and grad norm. The steps between them read only what is allowed by
name, each an exact count per step, microbatch or MoE layer, so one more read fails the test:
  batch_to_device  2 per microbatch: the loop moves its inputs and labels to the device (host ->
                   device on a GPU; on CPU a `.to(cpu)` like any other).
  ep_split_sizes   1 per MoE layer and microbatch: expert parallel's all-to-all needs each rank's token
                   counts on the host to size its buffers (dropless routing; TorchTitan's reads them too),
                   and expert TP's all-gather its tp ranks' counts: one read for both.
  spike_check      1 per step: health.spike_policy (on by default) reads the step's loss and grad norm,
                   together, to decide whether its update may go ahead (spike_policy = off reads nothing).
  moe_finite_flag  1 per step: the MoE bias update moves the finite flag to the counts' device (the
                   same device on a GPU).
  mesh_rank_grid   3 per step under context parallel: `get_mesh("cp")` slices the world mesh each step,
                   and torch's DeviceMesh reads its rank grid (tolist, nonzero, tolist), a host tensor
                   by design.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from distributed import run_calls
from helpers import tiny_args

pytestmark = pytest.mark.slow

STEPS, LOG_STEPS = 6, (1, 3, 6)


@dataclass(frozen=True)
class Allowance:
    file: str  # the innermost titanlite or torch frame that reads (host_reads.package_path) ...
    functions: tuple[str, ...]  # ... in one of these functions (qualified names)
    per: str  # what the case's count multiplies: "step", "microbatch" or "moe layer" (per microbatch)


ALLOWANCES = {
    "batch_to_device": Allowance("titanlite/trainer.py", ("Trainer.next_microbatches",), "microbatch"),
    "ep_split_sizes": Allowance("titanlite/parallel/expert.py", ("ExpertParallel._dispatch",), "moe layer"),
    "spike_check": Allowance("titanlite/health.py", ("SpikeGuard.skips",), "step"),
    "moe_finite_flag": Allowance("titanlite/trainer.py", ("Trainer.move_expert_bias",), "step"),
    "mesh_rank_grid": Allowance(
        "torch/distributed/device_mesh.py", ("DeviceMesh.__init__", "DeviceMesh._compute_coordinates_from_mesh"), "step"
    ),
}


def allowance_of(where: tuple[str, str]) -> str | None:
    file, function = where
    function = function.split(".<locals>")[0]  # a comprehension's frame counts as its function's
    return next((name for name, a in ALLOWANCES.items() if a.file == file and function in a.functions), None)


def _reads_per_step(dataset: str, folder: str, overrides: list[str]) -> dict:
    """This rank's reads by step, and what each allowance is counted per."""
    from host_reads import HostReads

    from titanlite.config import parse_args
    from titanlite.train import train
    from titanlite.trainer import Trainer

    torch._dynamo.reset()  # cases share a launch: a compiled case's graphs stay with it
    args = tiny_args(dataset, folder, "--training.steps", str(STEPS), "--metrics.log_freq", "3", *overrides)
    trainer = Trainer(parse_args(args), torch.device("cpu"))
    with HostReads(lambda: trainer.step) as reads:
        train(trainer)
    return {
        "reads": {step: reads.by_step[step] for step in range(1, STEPS + 1)},
        "units": {"step": 1, "microbatch": trainer.accumulation_steps, "moe layer": trainer.accumulation_steps * len(trainer.moe_layers)},
    }


MOE = ["--model.name", "moe", "--model.flavor", "debugmoe"]
ACCUMULATE = ["--training.global_batch_size"]  # tiny_args' local batch is 2: a bigger global batch accumulates
FLOAT8 = ["--model.converters", "float8", "--quantize.linear.float8.emulate", "true"]
CASES = {
    "one_rank": (1, [], {}),
    "one_rank_doc_accumulate_sac_float8": (1, ["--model.attn_mask_type", "block_causal", *ACCUMULATE, "4",
                                               "--activation_checkpoint.mode", "selective", *FLOAT8], {}),
    "one_rank_compiled_full_ac": (1, ["--compile.enable", "--activation_checkpoint.mode", "full"], {}),
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2"], {}),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"], {}),
    "fsdp2_tp2": (4, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"], {}),
}
FULL_CASES = {
    "pp2": (2, ["--parallelism.pipeline_parallel_degree", "2", *ACCUMULATE, "4",
                "--parallelism.pipeline_parallel_microbatch_size", "1"], {}),
    "cp2": (2, ["--parallelism.context_parallel_degree", "2"], {"mesh_rank_grid": 3}),
    "moe_ep2": (2, [*MOE, "--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2"],
                {"ep_split_sizes": 1, "moe_finite_flag": 1}),
    # Expert TP, and the global-batch aux loss, whose counts are summed over the ranks on the device.
    "moe_ep2_tp2_etp2": (4, [*MOE, "--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
                             "--parallelism.expert_tensor_parallel_degree", "2", "--model.moe_aux_loss_coeff", "0.01",
                             "--model.moe_aux_loss_type", "global_batch"],
                         {"ep_split_sizes": 1, "moe_finite_flag": 1}),
}


@pytest.fixture(scope="module")
def runs(request, corpus_jsonl, tmp_path_factory):
    """runs(case): every rank's reads of the case. The first case of a world size asked for runs every
    case of that size that this session selected, in one launch (process start dominates on CPU)."""
    every, done = CASES | FULL_CASES, {}
    selected = [item.callspec.id for item in request.session.items
                if item.originalname == "test_steps_that_do_not_log_read_nothing_from_the_device"]

    def of(case: str) -> list[dict]:
        if case not in done:
            world = every[case][0]
            names = [name for name in dict.fromkeys([*selected, case]) if every[name][0] == world and name not in done]
            folder = tmp_path_factory.mktemp(f"world{world}")
            calls = [(_reads_per_step, str(corpus_jsonl), str(folder / name), every[name][1]) for name in names]
            done.update(zip(names, run_calls(world, calls)))
        return done[case]

    return of


@pytest.mark.parametrize(
    "case", [*CASES, *(pytest.param(name, marks=pytest.mark.full) for name in FULL_CASES)], ids=[*CASES, *FULL_CASES]
)
def test_steps_that_do_not_log_read_nothing_from_the_device(runs, case):
    allowed = (CASES | FULL_CASES)[case][2]
    for rank, run in enumerate(runs(case)):
        per_step, units = run["reads"], run["units"]
        for step in LOG_STEPS:  # the recorder sees the log's reads of the loss and grad norm
            texts = " ".join(text for _, text in per_step[step])
            assert "(Trainer.global_loss)" in texts and re.search(r"titanlite/train.py:\d+ \(train\)", texts), f"rank {rank}, log step {step}: {texts}"
        expected = Counter({name: count * units[ALLOWANCES[name].per] for name, count in {"batch_to_device": 2, "spike_check": 1, **allowed}.items()})
        for step in sorted(set(per_step) - set(LOG_STEPS)):
            reads = Counter(allowance_of(where) or text for where, text in per_step[step])
            assert reads == expected, f"rank {rank}, step {step} read {dict(reads)}; allowed exactly {dict(expected)}"

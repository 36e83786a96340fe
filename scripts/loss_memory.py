"""Peak memory of the output projection + cross entropy, forward and backward, at a large vocabulary:
titanlite's loss on the whole logits, its chunked loss (training.loss_chunks), torch's
F.linear + F.cross_entropy, and TorchTitan's ChunkedLossWrapper (run with --torchtitan in a venv
that has torchtitan, such as the one the tool library's TorchTitan CPU runner builds).

    python scripts/loss_memory.py                       # titanlite and torch
    /tmp/tt-venv/bin/python scripts/loss_memory.py --torchtitan   # TorchTitan's (no titanlite import)

Each loss runs once in a fresh process: its memory is the growth of the process's peak resident
set over the step (inputs and the weight, allocated before, do not count), in MiB; a GPU run would
read the caching allocator's peak instead.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

VOCAB, DIM, TOKENS, CHUNKS = 128256, 256, 4096, 8  # Llama 3's vocabulary; 16 x 256 tokens a microbatch


def peak_mib(step) -> tuple[float, float]:
    """(growth of the peak resident set over one call of `step`, in MiB; seconds)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024, seconds


def inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(VOCAB, DIM, generator=gen) * DIM**-0.5)
    hidden = torch.randn(1, TOKENS, DIM, generator=gen, requires_grad=True)
    labels = torch.randint(0, VOCAB, (1, TOKENS), generator=gen)
    return hidden, weight, labels


def titanlite_steps(hidden, weight, labels) -> dict:
    from titanlite.loss import cross_entropy_sum
    from titanlite.models.common.linear import OutputProjection

    chunked = OutputProjection(DIM, VOCAB, bias=False)
    chunked.weight = weight
    chunked.loss_chunks = CHUNKS
    return {
        "torch F.linear + F.cross_entropy": lambda: F.cross_entropy(
            F.linear(hidden, weight).flatten(0, 1), labels.flatten(), reduction="sum").backward(),
        "titanlite, whole logits": lambda: cross_entropy_sum(F.linear(hidden, weight), labels).backward(),
        f"titanlite, loss_chunks {CHUNKS}": lambda: chunked(hidden, labels).backward(),
    }


def torchtitan_steps(hidden, weight, labels) -> dict:
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    lm_head = torch.nn.Linear(DIM, VOCAB, bias=False)
    lm_head.weight = weight
    wrapper = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=CHUNKS, loss_fn=CrossEntropyLoss.Config()))
    wrapper.set_lm_head(lm_head)

    def step():
        loss, _ = wrapper(hidden, labels)
        loss.backward()

    return {f"TorchTitan ChunkedLossWrapper, {CHUNKS} chunks": step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torchtitan", action="store_true", help="measure TorchTitan's chunked loss instead")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run this loss in this process
    args = parser.parse_args()
    torch.set_num_threads(2)
    hidden, weight, labels = inputs()
    steps = (torchtitan_steps if args.torchtitan else titanlite_steps)(hidden, weight, labels)
    if args.one is not None:
        peak, seconds = peak_mib(steps[args.one])
        print(json.dumps({"loss": args.one, "peak_mib": round(peak), "seconds": round(seconds, 2)}))
        return
    logits_mib = TOKENS * VOCAB * 4 / 2**20
    print(f"vocab {VOCAB}, dim {DIM}, {TOKENS} tokens: fp32 logits {logits_mib:,.0f} MiB; torch {torch.__version__}")
    for name in steps:
        flags = ["--torchtitan"] if args.torchtitan else []
        out = subprocess.run([sys.executable, __file__, *flags, "--one", name], capture_output=True, text=True, check=True)
        print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()

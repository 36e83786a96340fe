"""MoE numerics on a GPU (scripts/gpu_benchmark.sh runs it first): the experts' kernel chosen for the
device, the bf16 grouped GEMM against the exact loop, the router's top-k in a bf16 layer against
fp64 logits of the same inputs, and two bf16 forward + backward passes under
debug.deterministic's settings giving bitwise the same outputs and gradients. Prints one JSON line;
exits 1 if a check fails."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import torch

from titanlite.models import model_args
from titanlite.models.common.moe import MoE, configure_experts


def layer(device: torch.device) -> MoE:
    # Qwen3-30B-A3B's router shape: dim 2048, 128 experts, top 8; a small expert hidden size.
    args = replace(model_args("moe", "qwen3_30b_a3b", 0, 64), moe_hidden_dim=256)
    torch.manual_seed(0)
    moe = MoE(args).to(device)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02)
    moe.reset_state()
    return moe.to(torch.bfloat16)


def main() -> int:
    device = torch.device("cuda")
    moe = layer(device)
    why = configure_experts([moe.experts], True, device)
    x = torch.randn(4, 2048, 2048, device=device, dtype=torch.bfloat16)
    flat = x.view(-1, 2048)
    _, chosen, _ = moe.router(flat, moe.expert_bias)
    expected = (flat.double() @ moe.router.gate.weight.double().t()).topk(8, dim=-1).indices
    router_equal = torch.equal(chosen.sort(dim=-1).values, expected.sort(dim=-1).values)

    def run() -> tuple[torch.Tensor, ...]:
        moe.zero_grad()
        xr = x.clone().requires_grad_()
        out = moe(xr)
        out.float().pow(2).mean().backward()
        return out, xr.grad, moe.experts.w1.grad, moe.router.gate.weight.grad

    torch.use_deterministic_algorithms(True)
    first, second = run(), run()
    deterministic = all(torch.equal(a, b) for a, b in zip(first, second))
    torch.use_deterministic_algorithms(False)
    moe.experts.kernel = "loop"
    loop = run()
    grouped_vs_loop = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(first, loop))
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "kernel": why,
              "router_topk_equals_fp64": router_equal, "bitwise_repeatable": deterministic,
              "grouped_vs_loop_max_rel": grouped_vs_loop}
    print(json.dumps(result), flush=True)
    return 0 if router_equal and deterministic and grouped_vs_loop < 0.02 else 1


if __name__ == "__main__":
    sys.exit(main())

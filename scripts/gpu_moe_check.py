"""MoE numerics on a GPU (scripts/gpu_benchmark.sh runs it first): the experts' kernel chosen for the
device, the bf16 grouped GEMM against the exact loop, the router's top-k in a bf16 layer against
fp64 logits of the same inputs, and two bf16 forward + backward passes under
debug.deterministic's settings giving bitwise the same outputs and gradients; and the float8 grouped
GEMMs (torch._scaled_grouped_mm) against their fp32 emulation on the same float8 values, with both
kernels timed. Prints one JSON line; exits 1 if a check fails."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import torch

from titanlite.models import model_args
from titanlite.float8_grouped import float8_grouped_swiglu
from titanlite.models.common.moe import MoE, configure_experts, swiglu_experts


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
    float8 = float8_check(flat, chosen, moe)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "kernel": why,
              "router_topk_equals_fp64": router_equal, "bitwise_repeatable": deterministic,
              "grouped_vs_loop_max_rel": grouped_vs_loop, **float8}
    print(json.dumps(result), flush=True)
    return 0 if router_equal and deterministic and grouped_vs_loop < 0.02 and max(float8["float8_vs_emulated_l2_rel"]) < 0.02 else 1


def float8_check(flat: torch.Tensor, chosen: torch.Tensor, moe: MoE) -> dict:
    """Float8 grouped GEMMs at Qwen3-30B-A3B's expert shape (dim 2048, hidden 768): the SwiGLU of 16
    experts on 4,096 rows through torch._scaled_grouped_mm against its emulation on the CPU, outputs
    and gradients (relative L2); then forward + backward times of float8 and bf16 grouped GEMMs on the layer's
    routed copies of all its tokens, 128 experts (ms, median of 10)."""
    def weights(experts: int, device) -> list[torch.Tensor]:
        torch.manual_seed(1)
        return [torch.randn(experts, *shape).mul_(0.02).to(device) for shape in ((768, 2048), (2048, 768), (768, 2048))]

    def run(kernel, copies, counts, stored, device) -> tuple[torch.Tensor, ...]:
        x = copies.detach().to(device).clone().requires_grad_()
        ws = [w.to(device).bfloat16().requires_grad_() for w in stored]
        out = kernel(x, counts.to(device), *(w.transpose(-2, -1) for w in ws))
        out.float().pow(2).mean().backward()
        return (out, x.grad, *(w.grad for w in ws))

    def float8(emulate: bool):
        return lambda *a: float8_grouped_swiglu(*a, emulate=emulate)

    counts = torch.bincount(torch.randint(0, 16, (4096,), generator=torch.Generator().manual_seed(2)), minlength=16)
    copies, stored = flat[:4096], weights(16, "cpu")
    real = run(float8(False), copies, counts, stored, flat.device)
    emulated = run(float8(True), copies, counts, stored, torch.device("cpu"))
    # Float8 rounding is discontinuous: a bf16 ulp apart upstream flips some roundings downstream, so
    # the tensors are compared in L2 (output, x grad, w1, w2, w3 grads).
    l2 = [((a.float().cpu() - b.float()).norm() / b.float().norm()).item() for a, b in zip(real, emulated)]
    finite = all(torch.isfinite(t).all().item() for t in real)

    order = chosen.flatten().argsort(stable=True)
    copies, counts = flat[order // chosen.shape[1]], torch.bincount(chosen.flatten(), minlength=moe.num_experts)
    stored = weights(moe.num_experts, flat.device)

    def ms(kernel) -> float:
        times = []
        for _ in range(12):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(kernel, copies, counts, stored, flat.device)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times[2:])[len(times[2:]) // 2]

    return {"float8_vs_emulated_l2_rel": [round(e, 5) for e in l2] if finite else [float("inf")],
            "float8_grouped_fwd_bwd_ms": ms(float8(False)), "bf16_grouped_fwd_bwd_ms": ms(swiglu_experts),
            "routed_rows": int(counts.sum())}


if __name__ == "__main__":
    sys.exit(main())

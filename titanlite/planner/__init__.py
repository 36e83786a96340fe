"""A parallelism planner: memory per GPU and step time of candidate layouts, from shapes alone
(scripts/plan.py is its command line; docs/planner.md has the model, its constants and its errors).

  cost_model.py  the model: its constants (fitted and stated), Layout, Estimate, estimate()
  shapes.py      what it reads from a model's shapes (latent attention, multi-token prediction, routing,
                 Llama 4's chunks and interleaved MoE blocks)
  fit.py         the published runs it is fitted and checked on, and the fit of its constants
  search.py      the candidate layouts, the plan (those that fit, fastest first) and its explanation
  command.py     the run_train.sh line that trains a layout

Of the constants only GIB, GPU_OVERHEAD and FITTED (the fitted ones' names) are re-exported here:
fit_constants rebinds the fitted ones, so read and set them in cost_model, where estimate() reads
them (`from titanlite.planner import cost_model`; a copy here would go stale).
"""

from titanlite.planner.command import run_command, run_flags
from titanlite.planner.cost_model import FITTED, GIB, GPU_OVERHEAD, Estimate, Layout, estimate, gpu_family
from titanlite.planner.fit import PublishedRun, fit_constants, fit_loss, published_runs
from titanlite.planner.shapes import block_activation_elements, expert_params, stage_params
from titanlite.planner.search import (
    breakdown, candidate_layouts, differences, explain, outside_validation, plan, powers_of_two,
)

__all__ = [
    "FITTED", "GIB", "GPU_OVERHEAD", "Estimate", "Layout", "PublishedRun", "block_activation_elements", "breakdown",
    "candidate_layouts", "differences", "estimate", "expert_params", "explain", "fit_constants", "fit_loss", "gpu_family",
    "outside_validation", "plan", "powers_of_two", "published_runs", "run_command", "run_flags", "stage_params",
]

"""One helper every layout-aware part shares."""

from __future__ import annotations

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the same part on the same rank of every group), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t

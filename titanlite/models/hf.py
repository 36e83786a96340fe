"""A Hugging Face folder of any family, read through the mapping (models/<family>/hf.py) of the
family whose architecture its config.json names (scripts/convert_hf.py from-hf)."""

from __future__ import annotations

from pathlib import Path

from titanlite.checkpoint.hf import finite_hf_weights, read_hf_config
from titanlite.models import family_of_hf_model


def load_hf(folder: Path) -> dict:
    """Every weight of a Hugging Face folder as a titanlite state dict; one holding NaN or infinity stops
    the conversion in one line naming the tensor and its file."""
    config = read_hf_config(folder)[0]
    return dict(finite_hf_weights(family_of_hf_model(config.get("model_type"), folder).plan.hf.iter_hf, folder))

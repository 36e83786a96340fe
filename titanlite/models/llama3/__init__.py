"""Llama 3 (Meta's shapes): args and flavors, the model, its parallel plan, its Hugging Face mapping,
its checks."""

from titanlite.models.family import ModelFamily
from titanlite.models.llama3.args import LLAMA3_FLAVORS, check_config, check_llama3

FAMILY = ModelFamily(
    "llama3", LLAMA3_FLAVORS, check_llama3, check_config, "titanlite.models.llama3.parallel_plan", hf_model_type="llama"
)

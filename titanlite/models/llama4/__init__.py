"""Llama 4's text model (Scout and Maverick): interleaved MoE, NoPE blocks, chunked attention. Args and
flavors, the model, its parallel plan, its Hugging Face mapping (Llama4ForCausalLM), its checks."""

from titanlite.models.family import ModelFamily
from titanlite.models.llama4.args import LLAMA4_FLAVORS, check_config, check_hf_exportable, check_llama4

FAMILY = ModelFamily(
    "llama4", LLAMA4_FLAVORS, check_llama4, check_config, "titanlite.models.llama4.parallel_plan",
    check_hf_export=check_hf_exportable, hf_model_type="llama4_text",
)

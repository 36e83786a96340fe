"""gpt-oss (OpenAI's 20b and 120b): Llama's transformer with attention sinks, sliding windows on even
blocks, biased projections, YaRN, and clamped-SwiGLU experts with biases in every block. Args and
flavors, the model, its parallel plan, its Hugging Face mapping (GptOssForCausalLM), its checks."""

from titanlite.models.family import ModelFamily
from titanlite.models.gpt_oss.args import GPT_OSS_FLAVORS, check_config, check_gpt_oss, check_hf_exportable

FAMILY = ModelFamily(
    "gpt_oss", GPT_OSS_FLAVORS, check_gpt_oss, check_config, "titanlite.models.gpt_oss.parallel_plan",
    check_hf_export=check_hf_exportable, hf_model_type="gpt_oss",
)

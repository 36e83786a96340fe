"""The mixture-of-experts family (Qwen3-MoE, DeepSeek-MoE shapes): Llama 3's transformer with MoE
feed-forwards. Args and flavors, the model, its parallel plan, its Hugging Face mapping (Qwen3-MoE),
its checks."""

from titanlite.models.family import ModelFamily
from titanlite.models.moe.args import MOE_FLAVORS, check_config, check_hf_exportable, check_moe

FAMILY = ModelFamily(
    "moe", MOE_FLAVORS, check_moe, check_config, "titanlite.models.moe.parallel_plan",
    check_hf_export=check_hf_exportable, hf_model_type="qwen3_moe",
)

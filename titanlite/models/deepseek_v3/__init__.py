"""DeepSeek-V3 (and V2-Lite's shape): multi-head latent attention, group-limited MoE routing. Args and
flavors, the model, its parallel plan, its Hugging Face mapping (DeepseekV3ForCausalLM), its checks."""

from titanlite.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, check_config, check_deepseek_v3, check_hf_exportable
from titanlite.models.family import ModelFamily

FAMILY = ModelFamily(
    "deepseek_v3", DEEPSEEK_V3_FLAVORS, check_deepseek_v3, check_config, "titanlite.models.deepseek_v3.parallel_plan",
    check_hf_export=check_hf_exportable, hf_model_type="deepseek_v3",
)

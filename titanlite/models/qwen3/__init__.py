"""Qwen3's dense models (Qwen's published shapes): Llama 3's transformer with q/k head norms, heads wider
than dim / n_heads, and the small flavors' tied embeddings. Args and flavors, the plan (Llama 3's,
with Qwen3's Hugging Face mapping), its checks (Llama 3's)."""

from titanlite.models.family import ModelFamily
from titanlite.models.llama3.args import check_config, check_llama3
from titanlite.models.qwen3.args import QWEN3_FLAVORS

FAMILY = ModelFamily(
    "qwen3", QWEN3_FLAVORS, check_llama3, check_config, "titanlite.models.qwen3.parallel_plan", hf_model_type="qwen3"
)

"""Qwen3's parallel plan: Llama 3's (models/llama3/parallel_plan.py; the q/k norms sit inside each
head, which TP keeps whole), with Qwen3's Hugging Face mapping."""

from dataclasses import replace

from titanlite.models.llama3.parallel_plan import PLAN as LLAMA3_PLAN
from titanlite.models.qwen3 import hf

PLAN = replace(LLAMA3_PLAN, hf=hf)

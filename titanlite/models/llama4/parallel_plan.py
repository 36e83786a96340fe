"""Llama 4's parallel plan: the MoE family's (models/moe/parallel_plan.py). Its blocks have Llama's
names whether dense or MoE, RoPE or NoPE; what differs (chunks, QK-norm, temperature) is per head or
per token, so tensor parallel splits heads and sequence parallel gathers tokens as for Llama."""

from __future__ import annotations

from dataclasses import replace

from titanlite.models.llama4 import hf
from titanlite.models.llama4.model import Llama4Transformer
from titanlite.models.moe import parallel_plan as moe_plan

PLAN = replace(moe_plan.PLAN, build=Llama4Transformer, hf=hf)

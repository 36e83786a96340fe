"""titanlite: a small, readable, PyTorch-native LLM pre-training system."""

__version__ = "0.1.0"

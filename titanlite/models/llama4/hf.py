"""Placeholder until the Hugging Face mapping lands."""

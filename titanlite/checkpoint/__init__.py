"""Checkpoints: DCP save and load with exact resume (checkpointer.py), step folders (paths.py), the
reader that accepts only what DCP writes (reader.py), and the Hugging Face safetensors path (hf.py)."""

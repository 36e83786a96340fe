"""Optimizers (build.py: AdamW, Adam, Muon beside AdamW), the lr schedule (schedule.py) and the
gradients' norm and clipping (clip.py)."""

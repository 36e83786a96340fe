"""Layers and shapes the model families share: attention (masks, kernels, GQA), RoPE, SwiGLU, the
mixture-of-experts feed-forward, fused projections."""

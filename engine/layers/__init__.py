"""Decoder-layer building blocks shared by every backend: paged attention registered with
transformers, and the fused projections and norms."""

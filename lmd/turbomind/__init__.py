"""TurboMind-style engine: workspace loading, paged KV cache, persistent batching, kernels."""

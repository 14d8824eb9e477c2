"""Data efficiency: DeepSpeed's curriculum learning (legacy sequence-length warm-up and the
metric-driven sampler of its Data Efficiency library)."""

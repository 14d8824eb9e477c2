"""zserve: high-throughput LLM serving.

This package will own a model runner over a blocked (paged) KV cache with
ragged batching, the Dynamic SplitFuse scheduler, prefix caching, sampling,
the non-persistent ``pipeline()`` API, and an OpenAI-compatible HTTP server
with replicas. It loads Hugging Face-format checkpoints (config.json +
safetensors) and may use zquant's quantized models when installed.

Nothing is implemented yet; importing it gives only this docstring and the
version.
"""

__version__ = "0.1.0"

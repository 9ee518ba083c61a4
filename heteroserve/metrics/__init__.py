"""Prometheus metrics, named like vLLM's with the `heteroserve:` prefix.

The prefixes live here, apart from prometheus.py (which imports the engine), so the server's flags can offer them
without loading torch.
"""

PREFIX = "heteroserve:"
VLLM_PREFIX = "vllm:"
METRICS_PREFIXES = {"both": (PREFIX, VLLM_PREFIX), "heteroserve": (PREFIX,), "vllm": (VLLM_PREFIX,)}

"""Prometheus metrics, named like vLLM's with the `heteroserve:` prefix."""

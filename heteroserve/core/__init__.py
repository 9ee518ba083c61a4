"""The engine core: requests, KV blocks, scheduling, detokenization. Plain Python, no device code."""

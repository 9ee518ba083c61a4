"""The engine loop: requests in, incremental outputs out."""

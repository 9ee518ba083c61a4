"""User-facing entry points: the offline LLM class, the CLI, the servers."""

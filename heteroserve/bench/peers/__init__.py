"""The peers a bench command runs beside our engine, as `--peer` names them.

Each peer's harness imports its runtime (transformers, llama-cpp-python, vLLM's own virtualenv) and torch, so it is
imported only when a run names it: harness.py's runnable_peers and serve_command.py's vLLM comparison import it
then, and `heteroserve bench latency` on our engine alone loads none of them.
"""

PEERS = ("hf", "llama-cpp", "vllm")  # what --peer names

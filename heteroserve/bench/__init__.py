"""`heteroserve bench`: the workload of WORKLOAD.md run on heteroserve and on peers, in one process."""

PEERS = ("hf", "llama-cpp", "vllm")  # what --peer names

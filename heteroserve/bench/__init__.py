"""`heteroserve bench`: the workload of WORKLOAD.md run on heteroserve and on peers, in one process."""

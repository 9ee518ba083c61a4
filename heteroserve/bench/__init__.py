"""`heteroserve bench`: the workload of WORKLOAD.md run on heteroserve and, when asked, on peers (peers/)."""

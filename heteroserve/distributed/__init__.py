"""Tensor and pipeline parallelism: process groups, the collectives the model calls, checkpoint sharding."""

"""Runs the model: turns scheduler output into a batch, a forward pass and sampled tokens."""

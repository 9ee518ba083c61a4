"""Model definitions and weight loading; device-neutral torch code."""

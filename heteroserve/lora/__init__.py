"""LoRA adapters served on one base model (docs/LORA.md). Importing the package loads no torch: the engine core
keys requests and cache blocks by `LoRARequest` alone."""

from heteroserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]

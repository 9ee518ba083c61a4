"""Which LoRA adapter a request runs under, named as vLLM names it (`LoRARequest(name, id, path)`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter is identified by its integer id: the prefix cache and the resident slots key on it, so one id
    must always mean the same adapter folder (the engine refuses a known id with another path)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a name")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1 (0 is the base model), got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs a path (a PEFT adapter folder)")

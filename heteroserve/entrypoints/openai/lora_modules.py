"""The LoRA adapters a server serves by name: from --lora-modules at start and, with
--allow-runtime-lora-updating, loaded and unloaded at run time. Each name gets an id never used before, so an id
(which keys the prefix cache and the device slots) always means the same adapter folder."""

from __future__ import annotations

import argparse
import itertools
import json

from heteroserve.lora.request import LoRARequest


class LoRAModules:
    def __init__(self) -> None:
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return list(self._by_name)

    def adapters(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    def new(self, name: str, path: str) -> LoRARequest:
        """An adapter request with a fresh id (not yet served: `add` it once the engine has checked it)."""
        return LoRARequest(name, next(self._ids), path)

    def add(self, lora: LoRARequest) -> None:
        if lora.lora_name in self._by_name:
            raise ValueError(f"The lora adapter '{lora.lora_name}' has already been loaded.")
        self._by_name[lora.lora_name] = lora

    def remove(self, name: str) -> LoRARequest:
        """Stops serving the adapter under `name` (requests already running under it finish)."""
        if name not in self._by_name:
            raise KeyError(f"The lora adapter '{name}' cannot be found.")
        return self._by_name.pop(name)


def parse_lora_module(value: str) -> tuple[str, str, str | None]:
    """--lora-modules' forms, as vLLM's: name=path, or JSON {"name": ..., "path": ..., "base_model_name": ...}:
    (name, path, the base model's name if given; the server checks it is the model it serves)."""
    try:
        if value.lstrip().startswith("{"):
            parsed = json.loads(value)
            unknown = set(parsed) - {"name", "path", "base_model_name"}
            if unknown:
                raise ValueError(f"unknown keys {sorted(unknown)}")
            base = parsed.get("base_model_name")
            return str(parsed["name"]), str(parsed["path"]), None if base is None else str(base)
        name, path = value.split("=", 1)
        if not name or not path:
            raise ValueError("empty name or path")
        return name, path, None
    except (ValueError, KeyError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"expected name=path or a JSON object, got {value!r} ({exc})") from exc

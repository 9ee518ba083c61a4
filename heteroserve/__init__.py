"""heteroserve: a vLLM-style inference engine and OpenAI-compatible server for any torch device.

The public names load on first use (`__getattr__`), so `import heteroserve` and the light commands (`--help`,
`chat --url`, `gateway`) import no torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from heteroserve.entrypoints.llm import LLM
    from heteroserve.lora.request import LoRARequest
    from heteroserve.outputs import CompletionOutput, RequestOutput
    from heteroserve.sampling_params import RequestOutputKind, SamplingParams

_MODULE_OF = {
    "LLM": "heteroserve.entrypoints.llm",
    "LoRARequest": "heteroserve.lora.request",
    "SamplingParams": "heteroserve.sampling_params",
    "RequestOutputKind": "heteroserve.sampling_params",
    "RequestOutput": "heteroserve.outputs",
    "CompletionOutput": "heteroserve.outputs",
}

__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestOutputKind"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'heteroserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value
    return value

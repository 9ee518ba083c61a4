"""heteroserve: a vLLM-style inference engine and OpenAI-compatible server for any torch device."""

from heteroserve.entrypoints.llm import LLM
from heteroserve.lora.request import LoRARequest
from heteroserve.outputs import CompletionOutput, RequestOutput
from heteroserve.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestOutputKind"]
__version__ = "0.1.0"

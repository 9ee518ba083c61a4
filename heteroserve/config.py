"""Engine configuration: one validated dataclass per concern, named as vLLM names them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3
# None: what the checkpoint has (detected: GGUF, GPTQ, AWQ or float); "none": dequantise everything;
# "gguf" / "gptq" / "awq": insist on that format; "int4" / "int8": quantise a float checkpoint at load time.
QUANTIZATIONS = (None, "none", "gguf", "gptq", "awq", "int4", "int8")
# "auto": the activations' dtype; a 16-bit cache under float32 activations halves the KV memory and what a decode
# step reads from it (llama.cpp keeps its cache in float16 by default, F32 weights included).
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ReasoningFormat:
    """How a reasoning model's output marks its thinking; structured outputs apply to what follows it.
    `starts_in_reasoning`: the output is reasoning until `end` even without `start` (DeepSeek-R1's template ends
    the prompt with `<think>`); otherwise an output that does not open with `start` is all answer (Qwen3's)."""

    start: str
    end: str
    starts_in_reasoning: bool


# --reasoning-parser: the formats by vLLM's parser names (the server's parsers, reasoning_parsers.py, read these).
REASONING_FORMATS = {
    "qwen3": ReasoningFormat("<think>", "</think>", starts_in_reasoning=False),
    "deepseek_r1": ReasoningFormat("<think>", "</think>", starts_in_reasoning=True),
}
# --runner: "generate" (text out), "pooling" (embeddings and scores out), "auto": what the checkpoint is
# (a sentence-transformers folder, an encoder or a *ForSequenceClassification model pools; the rest generates).
RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("CLS", "MEAN", "LAST")
POOLING_BATCHED_TOKENS = 8192


@dataclass
class ModelConfig:
    model: str | None = None  # None: the embedded default model
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    quantization: str | None = None
    generation_config: str = "auto"  # "auto": the checkpoint's generation_config.json; "vllm": none
    runner: str = "auto"
    # Pooling models: overrides of what the checkpoint says, vLLM's --pooler-config keys ("pooling_type": CLS,
    # MEAN or LAST; "normalize": bool).
    pooler_config: dict | None = None
    # "cpu": a mixture of experts keeps its routers and routed experts in host memory, computed by the CPU platform,
    # while the rest of the model runs on the platform's device. None: with the rest.
    moe_experts_device: str | None = None

    def __post_init__(self) -> None:
        if self.moe_experts_device not in (None, "cpu"):
            raise ValueError(f"moe_experts_device must be 'cpu' (or unset), got {self.moe_experts_device!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.pooler_config is not None:
            unknown = set(self.pooler_config) - {"pooling_type", "normalize"}
            if unknown:
                raise ValueError(
                    f"unknown pooler_config keys: {', '.join(sorted(unknown))} (known: pooling_type, normalize)"
                )
            kind = self.pooler_config.get("pooling_type")
            if kind is not None and kind not in POOLING_TYPES:
                raise ValueError(f"pooler_config pooling_type must be one of {', '.join(POOLING_TYPES)}, got {kind!r}")
            normalize = self.pooler_config.get("normalize")
            if normalize is not None and not isinstance(normalize, bool):
                raise ValueError(f"pooler_config normalize must be true or false, got {normalize!r}")
        if self.dtype not in ("auto", "float32", "float", "bfloat16", "float16", "half"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.quantization not in QUANTIZATIONS:
            names = ", ".join(q for q in QUANTIZATIONS if q)
            raise ValueError(f"quantization must be one of {names} (or unset), got {self.quantization!r}")
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' or 'vllm', got {self.generation_config!r}")


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # None: the platform's default budget
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # overrides the budget, for tests and tuning
    gpu_memory_utilization: float | None = None  # devices: share of memory for weights + KV (None: platform's)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


@dataclass
class SchedulerConfig:
    """Built once the model's context length and kind are known (EngineArgs reads them from the checkpoint's
    config), so the token budget is settled here rather than patched in after the model loads."""

    max_num_seqs: int = 256
    # None: 2048 with chunked prefill, else max_model_len; a pooling model's is the longest input and at least 8192
    # (it computes each input whole in one step: more inputs per step, fewer steps).
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    max_model_len: int = 8192
    pooling: bool = False  # the model returns pooled hidden states instead of generating
    max_loras: int | None = None  # with LoRA: most adapters in one step (their requests wait for a free slot)
    max_prefill_tokens_per_step: int | None = None  # None: prompts fill the token budget (core/prefill_limit.py)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens is None:
            if self.pooling:
                self.max_num_batched_tokens = max(POOLING_BATCHED_TOKENS, self.max_model_len)
            else:
                self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else self.max_model_len
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_prefill_tokens_per_step is not None and self.max_prefill_tokens_per_step < 1:
            raise ValueError(f"max_prefill_tokens_per_step must be >= 1, got {self.max_prefill_tokens_per_step}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}), or a long prompt could never be scheduled"
            )


SELF_INT4 = "self-int4"  # a draft model spelled as the served checkpoint's own 4-bit copy
SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding, vLLM's `speculative_config`. Drafts for a greedy request come from an n-gram lookup
    (`{"method": "ngram", ...}`: the tokens that followed the latest earlier occurrence of the request's last n
    tokens) or from a smaller model with the same tokenizer (`{"model": path, ...}`, method "draft_model"; the
    model "self-int4" is the served checkpoint's own 4-bit copy). One forward pass of the served model checks a
    step's drafts; outputs stay those of plain greedy decoding. It pays where decoding streams the weights for a
    few tokens (one request, a few on a CPU or a GPU): n-gram drafts where text repeats its context, a draft
    model wherever it agrees with the served one.

    quantization: the draft model's (None: what its checkpoint has; self-int4 implies int4)."""

    method: str | None = None  # None: "draft_model" where a model is given, else "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int | None = None  # ngram only (default 4)
    prompt_lookup_min: int | None = None  # ngram only (default 1)
    model: str | None = None  # draft_model only
    quantization: str | None = None  # draft_model only

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "draft_model" if self.model is not None else "ngram"
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {self.num_speculative_tokens!r}")
        if self.method == "ngram":
            if self.model is not None or self.quantization is not None:
                given = "model" if self.model is not None else "quantization"
                raise ValueError(f"speculative_config {given} is for method draft_model; ngram drafts use no model")
            self.prompt_lookup_max = 4 if self.prompt_lookup_max is None else self.prompt_lookup_max
            self.prompt_lookup_min = 1 if self.prompt_lookup_min is None else self.prompt_lookup_min
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise ValueError(
                    f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} and "
                    f"{self.prompt_lookup_max}"
                )
            return
        if self.model is None:
            raise ValueError('speculative method draft_model needs a "model" (a checkpoint, or "self-int4")')
        if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
            raise ValueError("speculative_config prompt_lookup_max / prompt_lookup_min are for method ngram")
        if self.quantization not in QUANTIZATIONS:
            names = ", ".join(q for q in QUANTIZATIONS if q)
            raise ValueError(f"speculative_config quantization must be one of {names}, got {self.quantization!r}")
        if self.model == SELF_INT4 and self.quantization not in (None, "int4"):
            raise ValueError(
                f"speculative model self-int4 is the 4-bit copy; quantization {self.quantization} contradicts it"
            )

    @property
    def lookahead_slots(self) -> int:
        """KV slots a request needs past its scheduled tokens: a draft model writes its drafts' keys there."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def from_dict(cls, values: dict) -> SpeculativeConfig:
        """From vLLM's speculative_config dictionary; an unknown key is an error rather than ignored."""
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {', '.join(sorted(unknown))}")
        return cls(**values)


LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (vLLM's --enable-lora): how many adapters a step may mix (each holds a device slot), the
    largest rank a slot holds, and how many adapters stay read in host memory."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    lora_dtype: str = "auto"  # the slots' dtype: auto is the model's; a 16-bit one halves what a step reads

    def __post_init__(self) -> None:
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras


@dataclass
class DeviceConfig:
    device: str = "auto"
    kernels: str = "auto"  # "reference": plain torch operators everywhere, to check faster kernels against
    enforce_eager: bool = False  # no graph capture even where the platform has it (Platform.graph_capture)

    def __post_init__(self) -> None:
        if self.kernels not in ("auto", "reference"):
            raise ValueError(f"kernels must be 'auto' or 'reference', got {self.kernels!r}")


@dataclass
class MultimodalConfig:
    """Images for vision-language models (ignored by text models, which refuse images)."""

    limit_images_per_prompt: int = 8  # --limit-mm-per-prompt image=N
    min_pixels: int | None = None  # the image processor's resize budget; None: the checkpoint's
    max_pixels: int | None = None
    max_image_pixels: int = 64 * 1024**2  # width x height of an input image before resizing
    # Of all of one request's input images together: eight 4096x4096 or two 8192x8192 ones (~400 MB as RGB).
    max_request_image_pixels: int = 128 * 1024**2

    def __post_init__(self) -> None:
        if self.limit_images_per_prompt < 0:
            raise ValueError(f"the image limit per prompt must be >= 0, got {self.limit_images_per_prompt}")
        for name in ("min_pixels", "max_pixels", "max_image_pixels", "max_request_image_pixels"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) is larger than max_pixels ({self.max_pixels})")


@dataclass
class ParallelConfig:
    """How many ranks run the model and where: tensor x pipeline ranks, spread evenly over `nnodes` machines
    that meet at `master_addr:master_port` (torch.distributed's TCP rendezvous)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: in-process for one rank, "mp" for more
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port on one node, 29500 (torch's default) across nodes
    enable_expert_parallel: bool = False  # MoE layers: whole experts per tensor-parallel rank

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            raise ValueError(
                f"distributed_executor_backend must be mp or ray, got {self.distributed_executor_backend!r}"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.world_size % self.nnodes:
            raise ValueError(
                f"{self.world_size} ranks (tensor x pipeline parallel) do not split evenly over {self.nnodes} nodes"
            )
        if self.nnodes > 1 and self.distributed_executor_backend == "ray":
            raise ValueError("with Ray, start a Ray cluster on the nodes instead of passing --nnodes")
        if self.master_port is None and self.nnodes > 1:
            self.master_port = 29500
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def executor_backend(self) -> str:
        """uni (in-process), mp or ray."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 and self.nnodes == 1 else "mp"


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    multimodal: MultimodalConfig = field(default_factory=MultimodalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None  # None: LoRA adapters are refused
    # How reasoning models mark their thinking (vLLM's --reasoning-parser): structured outputs start after it.
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_FORMATS:
            raise ValueError(
                f"unknown reasoning parser {self.reasoning_parser!r}; known: {', '.join(sorted(REASONING_FORMATS))}"
            )
        if self.lora is not None:
            if self.scheduler.pooling:
                raise ValueError("LoRA adapters are served on generating models; this model pools (embed / score)")
            self.scheduler.max_loras = self.lora.max_loras

"""Every engine setting, listed once: the CLI flags, `LLM`'s keyword arguments and `EngineConfig` come from here."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from heteroserve.config import (
    KV_CACHE_DTYPES,
    LORA_DTYPES,
    REASONING_FORMATS,
    RUNNERS,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    MultimodalConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from heteroserve.engine.byte_size import byte_size

ENGINE_GROUP = "engine"
PARALLEL_GROUP = "parallelism (docs/PLATFORMS.md)"


def _setting(
    default: Any,
    help: str | None = None,
    *,
    choices: list[str] | None = None,
    parse: Callable[[str], Any] | None = None,
    aliases: tuple[str, ...] = (),
    metavar: str | None = None,
    group: str = ENGINE_GROUP,
) -> Any:
    """A field whose metadata says how its CLI flag reads: `parse` turns the flag's text into the field's value."""
    metadata = {"help": help, "choices": choices, "parse": parse, "aliases": aliases, "metavar": metavar}
    return dataclasses.field(default=default, metadata={**metadata, "group": group})


def _object(value: str) -> dict:
    parsed = json.loads(value)  # a JSONDecodeError is a ValueError
    if not isinstance(parsed, dict):
        raise ValueError("expected a JSON object")
    return parsed


def _json_object(value: str) -> dict:
    try:
        return _object(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r} ({exc})") from exc


def _image_limit(value: str) -> dict[str, int]:
    """'image=N' or '{"image": N}' -> {"image": N}, the form `LLM(limit_mm_per_prompt=...)` takes."""
    try:
        parsed = json.loads(value) if value.lstrip().startswith("{") else dict([value.split("=", 1)])
        unknown = set(parsed) - {"image"}
        if unknown:
            raise ValueError(f"only images are supported, not {sorted(unknown)}")
        return {"image": int(parsed["image"])}
    except (ValueError, KeyError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"expected image=N, got {value!r} ({exc})") from exc


def _pooler_config(value: str) -> dict:
    try:
        parsed = _object(value)
        ModelConfig(pooler_config=parsed)  # the same checks as the offline API's
        return parsed
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"invalid pooler config {value!r}: {exc}") from exc


def _speculative_config(value: str) -> dict:
    try:
        parsed = _object(value)
        SpeculativeConfig.from_dict(parsed)
        return parsed
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"invalid speculative config {value!r}: {exc}") from exc


@dataclass
class EngineArgs:
    """One field per engine setting, named as vLLM names it: `--max-model-len` on the command line is
    `LLM(max_model_len=...)` in Python and `EngineConfig.model.max_model_len` in the engine."""

    model: str | None = None  # None: the embedded default model; each command takes it its own way
    dtype: str = _setting(
        "auto",
        "weights and activations dtype (auto: the checkpoint's, float32 where unsupported)",
        choices=["auto", "float32", "bfloat16", "float16"],
    )
    max_model_len: int | None = _setting(None, "context length (default: the model's)")
    block_size: int = _setting(16, "tokens per KV-cache block")
    max_num_seqs: int = _setting(256, "most requests running at once")
    max_num_batched_tokens: int | None = _setting(None, "token budget per step")
    max_prefill_tokens_per_step: int | None = _setting(
        None,
        "most prompt tokens one step prefills while several prompts wait (0 or unset: the token budget; the server's "
        "default is 256): a burst's first clients start decoding while the rest prefill, so the median client's "
        "first token comes sooner",
    )
    enable_prefix_caching: bool = _setting(True, "reuse the KV blocks of a prompt prefix already computed")
    enable_chunked_prefill: bool = _setting(True, "split long prompts over steps, alongside decoding requests")
    kv_cache_memory_bytes: int | str | None = _setting(
        None,
        "bytes for the KV block pool, e.g. 4GiB, 512MB or 1073741824 (CPU default: what max_num_seqs requests of "
        "max_model_len take, at most 2 GiB and a quarter of available memory); overrides --gpu-memory-utilization",
        parse=byte_size,
        metavar="BYTES",
    )
    num_kv_blocks: int | None = _setting(
        None,
        "KV-cache blocks to allocate, overriding the memory budget (per KV group: windowed layers have their own)",
    )
    gpu_memory_utilization: float | None = _setting(
        None,
        "devices: share of device memory for weights + KV cache (default 0.9); CPU: use --kv-cache-memory-bytes",
    )
    kv_cache_dtype: str = _setting(
        "auto",
        "KV cache dtype (auto: the activations'); float16 or bfloat16 under float32 activations halves the "
        "cache's memory and what decode attention reads, at 16-bit precision for keys and values",
        choices=list(KV_CACHE_DTYPES),
    )
    scheduling_policy: str = _setting("fcfs", "order of admission", choices=["fcfs", "priority"])
    runner: str = _setting(
        "auto",
        "generate (text) or pooling (embeddings, rerank, score); auto: pooling for a sentence-transformers, "
        "encoder or sequence-classification checkpoint",
        choices=list(RUNNERS),
    )
    pooler_config: dict | None = _setting(
        None,
        'a pooling model\'s overrides, e.g. \'{"pooling_type": "MEAN", "normalize": false}\' (CLS, MEAN, LAST)',
        parse=_pooler_config,
    )
    reasoning_parser: str | None = _setting(
        None,
        "how the model marks its thinking: chat answers split it into reasoning_content, and structured "
        "outputs apply after it",
        choices=sorted(REASONING_FORMATS),
    )
    speculative_config: dict | None = _setting(
        None,
        'speculative decoding for greedy requests, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 1}\' (drafts looked up in the request\'s own tokens), or '
        '\'{"model": PATH, "num_speculative_tokens": 4}\' (a draft model with the same tokenizer; "self-int4": '
        "the served float model's own 4-bit copy)",
        parse=_speculative_config,
    )
    enable_lora: bool = _setting(False, "serve LoRA adapters on the base model (--lora-modules, LoRARequest)")
    max_loras: int = _setting(1, "most adapters in one step (each holds a device slot; others wait their turn)")
    max_lora_rank: int = _setting(16, "largest adapter rank accepted (the size of a slot)")
    max_cpu_loras: int | None = _setting(None, "adapters kept read in host memory (default: --max-loras)")
    lora_dtype: str = _setting(
        "auto",
        "dtype the adapters are held and multiplied in: auto is the model's; bfloat16 or float16 halve what a step "
        "reads of them (a float32 adapter is rounded once, at load)",
        choices=list(LORA_DTYPES),
    )
    generation_config: str = _setting(
        "auto", "auto: apply the checkpoint's generation_config.json defaults", choices=["auto", "vllm"]
    )
    device: str = _setting(
        "auto",
        "auto, cpu, cuda, rocm, npu, mlu, xpu, mps or a plugin's name ($HETEROSERVE_DEVICE also works; "
        "`heteroserve env` lists them)",
    )
    kernels: str = _setting(
        "auto", "auto: the platform's fastest kernels; reference: plain torch operators", choices=["auto", "reference"]
    )
    enforce_eager: bool = _setting(
        False, "run every step as it comes: no decode graphs where the device has them (CUDA graphs)"
    )
    quantization: str | None = _setting(
        None,
        "unset: as the checkpoint is (GGUF, GPTQ, AWQ detected and kept compressed); none: dequantise; "
        "gguf/gptq/awq: insist on that format; int4/int8: quantise a float checkpoint at load",
        choices=["none", "gguf", "gptq", "awq", "int4", "int8"],
        aliases=("-q",),
    )
    seed: int = _setting(0, "engine seed (and the bench's random dataset seed)")
    limit_mm_per_prompt: dict[str, int] | None = _setting(
        None,
        f"most images in one prompt (default {MultimodalConfig.limit_images_per_prompt}; also accepts vLLM's "
        "JSON form '{\"image\": N}')",
        parse=_image_limit,
        metavar="image=N",
    )
    mm_processor_kwargs: dict[str, int] | None = _setting(
        None,
        'image processor pixel budget as JSON, e.g. \'{"min_pixels": 3136, "max_pixels": 1003520}\'',
        parse=_json_object,
    )
    max_image_pixels: int = _setting(
        MultimodalConfig.max_image_pixels,
        "largest input image (width x height, before resizing); larger ones are answered 400",
    )
    max_request_image_pixels: int = _setting(
        MultimodalConfig.max_request_image_pixels,
        "most input image pixels in one request, all images together (checked before decoding each)",
    )
    tensor_parallel_size: int = _setting(1, "ranks that split each layer", aliases=("-tp",), group=PARALLEL_GROUP)
    pipeline_parallel_size: int = _setting(1, "ranks that split the layers", aliases=("-pp",), group=PARALLEL_GROUP)
    moe_experts_device: str | None = _setting(
        None,
        "cpu: a mixture of experts' routers and routed experts stay in host memory and run on the CPU platform's "
        "kernels while the rest runs on the device (llama.cpp's --cpu-moe); hidden states cross once a layer each way",
        choices=["cpu"],
        group=PARALLEL_GROUP,
    )
    enable_expert_parallel: bool = _setting(
        False,
        "mixture-of-experts layers: each tensor-parallel rank holds whole experts (an even share of them) instead of "
        "a slice of every expert",
        group=PARALLEL_GROUP,
    )
    distributed_executor_backend: str | None = _setting(
        None,
        "mp: worker processes (default for more than one rank); ray: Ray actors (pip install heteroserve[ray])",
        choices=["mp", "ray"],
        group=PARALLEL_GROUP,
    )
    nnodes: int = _setting(1, "machines the ranks are spread over", group=PARALLEL_GROUP)
    node_rank: int = _setting(0, "this machine's index; > 0 runs workers only", group=PARALLEL_GROUP)
    master_addr: str = _setting("127.0.0.1", "address of node 0 (torch.distributed rendezvous)", group=PARALLEL_GROUP)
    master_port: int | None = _setting(
        None, "rendezvous port on node 0 (default: free port; 29500 on nodes)", group=PARALLEL_GROUP
    )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field but `model` (`--max-model-len` for max_model_len), in the engine and parallelism
        groups; a bool is a `--x / --no-x` pair."""
        groups: dict[str, Any] = {}  # argument groups by title
        for setting in fields(cls):
            if setting.name == "model":
                continue
            title = setting.metadata["group"]
            if title not in groups:
                groups[title] = parser.add_argument_group(title)
            cls.add_cli_arg(groups[title], setting.name)

    @classmethod
    def add_cli_arg(cls, parser: argparse.ArgumentParser | Any, name: str, note: str | None = None) -> None:
        """The flag of one setting, for a command that takes only some of them (`export onnx`'s --dtype); `note`
        is added to its help, saying what the setting means to that command."""
        setting = next(f for f in fields(cls) if f.name == name)
        hint = _type_hints(cls)[name]
        meta = setting.metadata
        options: dict[str, Any] = {"default": setting.default, "help": meta["help"] + (f"; {note}" if note else "")}
        if hint is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = meta["parse"] or _scalar_type(hint)
            for key in ("choices", "metavar"):
                if meta[key] is not None:
                    options[key] = meta[key]
        parser.add_argument(cli_flag(name), *meta["aliases"], **options)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, model: str | None) -> EngineArgs:
        return cls(model=model, **{f.name: getattr(args, f.name) for f in fields(cls) if f.name != "model"})

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineArgs:
        """`LLM`'s keyword arguments: an unknown one is a TypeError naming it and the settings it may have meant."""
        known = [f.name for f in fields(cls) if f.name != "model"]
        for name in kwargs:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=3)
                hint = f"; did you mean {' or '.join(close)}?" if close else " (EngineArgs lists the settings)"
                raise TypeError(f"LLM got an unexpected keyword argument {name!r}{hint}")
        return cls(model=model, **kwargs)

    def create_engine_config(self) -> EngineConfig:
        """Every sub-config by keyword. The context length and whether the model pools are read from the
        checkpoint's config first, so the scheduler's token budget is settled when SchedulerConfig is built."""
        from heteroserve.model.loader.limits import checkpoint_limits  # reads the checkpoint: transformers, gguf

        model = ModelConfig(
            model=self.model,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            seed=self.seed,
            quantization=self.quantization,
            generation_config=self.generation_config,
            runner=self.runner,
            pooler_config=self.pooler_config,
            moe_experts_device=self.moe_experts_device,
        )
        limits = checkpoint_limits(model)
        model = dataclasses.replace(model, max_model_len=limits.max_model_len)
        pixels = self.mm_processor_kwargs or {}
        speculative = None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)
        images = (self.limit_mm_per_prompt or {}).get("image", MultimodalConfig.limit_images_per_prompt)
        return EngineConfig(
            model=model,
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=None
                if self.kv_cache_memory_bytes is None
                else byte_size(self.kv_cache_memory_bytes),
                enable_prefix_caching=self.enable_prefix_caching,
                num_kv_blocks=self.num_kv_blocks,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_dtype=self.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_prefill_tokens_per_step=self.max_prefill_tokens_per_step or None,
                enable_chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy,
                max_model_len=limits.max_model_len,
                pooling=limits.pooling,
            ),
            device=DeviceConfig(device=self.device, kernels=self.kernels, enforce_eager=self.enforce_eager),
            multimodal=MultimodalConfig(
                limit_images_per_prompt=images,
                min_pixels=pixels.get("min_pixels"),
                max_pixels=pixels.get("max_pixels"),
                max_image_pixels=self.max_image_pixels,
                max_request_image_pixels=self.max_request_image_pixels,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                enable_expert_parallel=self.enable_expert_parallel,
                distributed_executor_backend=self.distributed_executor_backend,
                nnodes=self.nnodes,
                node_rank=self.node_rank,
                master_addr=self.master_addr,
                master_port=self.master_port,
            ),
            speculative=speculative,
            lora=self._lora_config(),
            reasoning_parser=self.reasoning_parser,
        )

    def _lora_config(self) -> LoRAConfig | None:
        if self.enable_lora:
            return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras, self.lora_dtype)
        if self.lora_dtype != "auto":
            raise ValueError("lora_dtype applies to LoRA adapters: set enable_lora (--enable-lora) as well")
        return None


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """The fields' annotations evaluated, once: every command's parser adds these flags."""
    return typing.get_type_hints(cls)


def cli_flag(name: str) -> str:
    """A field's flag: max_model_len -> --max-model-len."""
    return "--" + name.replace("_", "-")


def _scalar_type(hint: object) -> type:
    """int for `int | None`: what argparse converts a flag's text with."""
    options = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    return options[0]

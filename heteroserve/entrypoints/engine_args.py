"""Engine flags with vLLM's names, shared by every command that builds an engine."""

from __future__ import annotations

import argparse
import json

from heteroserve.config import (
    KV_CACHE_DTYPES,
    REASONING_END_MARKERS,
    RUNNERS,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    MultimodalConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations dtype (auto: the checkpoint's, float32 where unsupported)",
    )
    group.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    group.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    group.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="bytes for the KV block pool (CPU default: 2 GiB); overrides --gpu-memory-utilization",
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="devices: share of device memory for weights + KV cache (default 0.9); CPU: use --kv-cache-memory-bytes",
    )
    group.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="KV cache dtype (auto: the activations'); float16 or bfloat16 under float32 activations halves the "
        "cache's memory and what decode attention reads, at 16-bit precision for keys and values",
    )
    group.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    group.add_argument(
        "--runner",
        default="auto",
        choices=list(RUNNERS),
        help="generate (text) or pooling (embeddings, rerank, score); auto: pooling for a sentence-transformers, "
        "encoder or sequence-classification checkpoint",
    )
    group.add_argument(
        "--pooler-config",
        type=_pooler_config,
        default=None,
        help='a pooling model\'s overrides, e.g. \'{"pooling_type": "MEAN", "normalize": false}\' (CLS, MEAN, LAST)',
    )
    group.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_END_MARKERS),
        help="how the model marks its thinking: chat answers split it into reasoning_content, and structured "
        "outputs apply after it",
    )
    group.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        help='speculative decoding for greedy requests, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 1}\' (drafts looked up in the request\'s own tokens)',
    )
    group.add_argument(
        "--generation-config",
        default="auto",
        choices=["auto", "vllm"],
        help="auto: apply the checkpoint's generation_config.json defaults",
    )
    group.add_argument(
        "--device",
        default="auto",
        help="auto, cpu, cuda, rocm, npu, mlu, xpu, mps or a plugin's name ($HETEROSERVE_DEVICE also works; "
        "`heteroserve env` lists them)",
    )
    group.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "reference"],
        help="auto: the platform's fastest kernels; reference: plain torch operators",
    )
    group.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["none", "gguf", "gptq", "awq", "int4", "int8"],
        help="unset: as the checkpoint is (GGUF, GPTQ, AWQ detected and kept compressed); none: dequantise; "
        "gguf/gptq/awq: insist on that format; int4/int8: quantise a float checkpoint at load",
    )
    group.add_argument("--seed", type=int, default=0, help="engine seed (and the bench's random dataset seed)")
    group.add_argument(
        "--limit-mm-per-prompt",
        type=_image_limit,
        default=MultimodalConfig.limit_images_per_prompt,
        metavar="image=N",
        help="most images in one prompt (also accepts vLLM's JSON form '{\"image\": N}')",
    )
    group.add_argument(
        "--mm-processor-kwargs",
        type=json.loads,
        default=None,
        help='image processor pixel budget as JSON, e.g. \'{"min_pixels": 3136, "max_pixels": 1003520}\'',
    )
    group.add_argument(
        "--max-image-pixels",
        type=int,
        default=MultimodalConfig.max_image_pixels,
        help="largest input image (width x height, before resizing); larger ones are answered 400",
    )
    group.add_argument(
        "--max-request-image-pixels",
        type=int,
        default=MultimodalConfig.max_request_image_pixels,
        help="most input image pixels in one request, all images together (checked before decoding each)",
    )

    add_parallel_args(parser)


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallelism (docs/PLATFORMS.md)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks that split each layer")
    group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="ranks that split the layers")
    group.add_argument(
        "--distributed-executor-backend",
        default=None,
        choices=["mp", "ray"],
        help="mp: worker processes (default for more than one rank); ray: Ray actors (pip install heteroserve[ray])",
    )
    group.add_argument("--nnodes", type=int, default=1, help="machines the ranks are spread over")
    group.add_argument("--node-rank", type=int, default=0, help="this machine's index; > 0 runs workers only")
    group.add_argument("--master-addr", default="127.0.0.1", help="address of node 0 (torch.distributed rendezvous)")
    group.add_argument(
        "--master-port", type=int, default=None, help="rendezvous port on node 0 (default: free port; 29500 on nodes)"
    )


def _image_limit(value: str) -> int:
    """'image=N' or '{"image": N}' -> N."""
    try:
        parsed = json.loads(value) if value.lstrip().startswith("{") else dict([value.split("=", 1)])
        unknown = set(parsed) - {"image"}
        if unknown:
            raise ValueError(f"only images are supported, not {sorted(unknown)}")
        return int(parsed["image"])
    except (ValueError, KeyError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"expected image=N, got {value!r} ({exc})") from exc


def _pooler_config(value: str) -> dict:
    try:
        parsed = json.loads(value)
        if not isinstance(parsed, dict):
            raise ValueError("expected a JSON object")
        ModelConfig(pooler_config=parsed)  # the same checks as the offline API's
        return parsed
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"invalid pooler config {value!r}: {exc}") from exc


def _speculative_config(value: str) -> SpeculativeConfig:
    try:
        parsed = json.loads(value)
        if not isinstance(parsed, dict):
            raise ValueError("expected a JSON object")
        return SpeculativeConfig.from_dict(parsed)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"invalid speculative config {value!r}: {exc}") from exc


def engine_config_from_args(model: str | None, args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(
            model,
            args.dtype,
            args.max_model_len,
            args.seed,
            args.quantization,
            generation_config=args.generation_config,
            runner=args.runner,
            pooler_config=args.pooler_config,
        ),
        cache=CacheConfig(
            args.block_size,
            args.kv_cache_memory_bytes,
            args.enable_prefix_caching,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(
            args.max_num_seqs,
            args.max_num_batched_tokens,
            args.enable_chunked_prefill,
            args.scheduling_policy,
        ),
        device=DeviceConfig(args.device, args.kernels),
        multimodal=MultimodalConfig(
            args.limit_mm_per_prompt,
            (args.mm_processor_kwargs or {}).get("min_pixels"),
            (args.mm_processor_kwargs or {}).get("max_pixels"),
            args.max_image_pixels,
            args.max_request_image_pixels,
        ),
        parallel=ParallelConfig(
            args.tensor_parallel_size,
            args.pipeline_parallel_size,
            args.distributed_executor_backend,
            args.nnodes,
            args.node_rank,
            args.master_addr,
            args.master_port,
        ),
        speculative=args.speculative_config,
        reasoning_parser=args.reasoning_parser,
    )

"""Engine flags with vLLM's names, shared by every command that builds an engine."""

from __future__ import annotations

import argparse

from heteroserve.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
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
        help="bytes for the KV block pool (CPU default: 2 GiB)",
    )
    group.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
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
        choices=["none", "gguf", "int4"],
        help="unset: as the checkpoint is (GGUF 4-bit stays 4-bit); none: dequantise; "
        "int4: quantise a float checkpoint at load",
    )
    group.add_argument("--seed", type=int, default=0, help="engine seed (and the bench's random dataset seed)")
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


def engine_config_from_args(model: str | None, args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(
            model,
            args.dtype,
            args.max_model_len,
            args.seed,
            args.quantization,
            generation_config=args.generation_config,
        ),
        cache=CacheConfig(args.block_size, args.kv_cache_memory_bytes, args.enable_prefix_caching),
        scheduler=SchedulerConfig(
            args.max_num_seqs,
            args.max_num_batched_tokens,
            args.enable_chunked_prefill,
            args.scheduling_policy,
        ),
        device=DeviceConfig(args.device, args.kernels),
        parallel=ParallelConfig(
            args.tensor_parallel_size,
            args.pipeline_parallel_size,
            args.distributed_executor_backend,
            args.nnodes,
            args.node_rank,
            args.master_addr,
            args.master_port,
        ),
    )

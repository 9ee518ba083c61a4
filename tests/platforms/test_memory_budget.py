"""How big the KV block pool is: on the CPU what the engine's limits can fill (max_num_seqs requests of
max_model_len) within a cap, with pages taken as blocks are written; a share of device memory elsewhere
(--gpu-memory-utilization)."""

from __future__ import annotations

import logging

import pytest
import torch

from heteroserve import LLM
from heteroserve.config import DEFAULT_CPU_KV_CACHE_BYTES, CacheConfig
from heteroserve.engine.engine_args import EngineArgs
from heteroserve.entrypoints.openai.server_args import make_parser
from heteroserve.platforms.cpu.platform import CpuPlatform, host_memory
from heteroserve.platforms.interface import Platform
from heteroserve.worker.model_runner import kv_cache_dtype
from tests.model.tiny_models import save_tiny

GiB = 1024**3


class TenGiBDevice(Platform):
    """A device that reports 10 GiB of memory of which 4 GiB (weights, runtime) are in use."""

    name = "ten-gib"

    def memory_info(self) -> tuple[int, int]:
        return 6 * GiB, 10 * GiB


def test_device_budget_is_the_share_left_after_the_weights():
    device = TenGiBDevice()
    assert device.kv_cache_budget_bytes(None) == int(10 * GiB * 0.9) - 4 * GiB
    assert device.kv_cache_budget_bytes(None, 0.5) == 1 * GiB
    assert device.kv_cache_budget_bytes(None, 0.3) == 0  # the weights already take more than the share
    assert device.kv_cache_budget_bytes(3 * GiB, 0.5) == 3 * GiB  # an explicit size wins


def test_cpu_budget_ignores_the_device_share_and_says_so(caplog):
    with caplog.at_level(logging.WARNING):
        assert CpuPlatform().kv_cache_budget_bytes(None, 0.5) == CpuPlatform().kv_cache_budget_bytes(None)
    assert "kv_cache_memory_bytes" in caplog.text


def test_cpu_budget_is_what_the_limits_can_fill_within_its_cap():
    cpu = CpuPlatform()
    assert cpu.kv_cache_budget_bytes(None, wanted=100 * 1024**2) == 100 * 1024**2
    cap = min(DEFAULT_CPU_KV_CACHE_BYTES, host_memory()[0] // 4)
    assert cpu.kv_cache_budget_bytes(None, wanted=64 * GiB) == cap == cpu.kv_cache_budget_bytes(None)
    assert cpu.kv_cache_budget_bytes(3 * GiB, wanted=1024) == 3 * GiB  # an explicit size wins


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_cpu_kv_cache_is_resident_from_the_start():
    """A 256 MiB pool is taken from the OS at allocation (no page faults in a step); it reads as zeros and is
    64-byte aligned."""
    before = resident_bytes()
    pool = CpuPlatform().allocate_kv_cache((2, 2, 512, 16, 64, 64), torch.float32)  # 256 MiB
    assert resident_bytes() - before > 240 * 1024**2
    assert pool.data_ptr() % 64 == 0 and pool.shape == (2, 2, 512, 16, 64, 64)
    assert not pool[:, :, ::97].any()
    pool[0, 0, 5] = 1.0
    assert pool.sum() == 16 * 64 * 64
    half = CpuPlatform().allocate_kv_cache((3, 64), torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.data_ptr() % 64 == 0 and not half.any()


def test_the_engine_sizes_the_cpu_cache_for_max_num_seqs_requests(tmp_path, caplog):
    tiny = save_tiny("qwen2", tmp_path)
    with caplog.at_level(logging.INFO):
        llm = LLM(model=str(tiny.folder), dtype="float32", max_model_len=64, block_size=16, max_num_seqs=3)
    assert llm.engine.executor.worker.runner.num_blocks == 3 * 64 // 16
    assert "room for 3.0 requests of max_model_len=64" in caplog.text and "--kv-cache-memory-bytes" in caplog.text


def test_flag_reaches_the_cache_config_and_is_checked():
    args = make_parser().parse_args(["--gpu-memory-utilization", "0.75"])
    assert EngineArgs.from_cli_args(args, None).create_engine_config().cache.gpu_memory_utilization == 0.75
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=1.5)


def test_kv_cache_dtype_flag_reaches_the_cache_config_and_is_checked(capsys):
    args = make_parser().parse_args(["--kv-cache-dtype", "float16"])
    assert EngineArgs.from_cli_args(args, None).create_engine_config().cache.kv_cache_dtype == "float16"
    default = EngineArgs.from_cli_args(make_parser().parse_args([]), None).create_engine_config()
    assert default.cache.kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--kv-cache-dtype", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, float16, bfloat16"):
        CacheConfig(kv_cache_dtype="fp8")


def test_kv_cache_dtype_is_the_activations_or_narrower_under_float32():
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("float16", torch.float32) == torch.float16
    assert kv_cache_dtype("bfloat16", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype=float32 needs float32 activations"):
        kv_cache_dtype("float32", torch.float16)

"""How big the KV block pool is: a fixed size on CPU, a share of device memory elsewhere (--gpu-memory-utilization)."""

from __future__ import annotations

import logging

import pytest
import torch

from heteroserve.config import CacheConfig
from heteroserve.engine.engine_args import EngineArgs
from heteroserve.entrypoints.openai.server_args import make_parser
from heteroserve.platforms.cpu.platform import CpuPlatform
from heteroserve.platforms.interface import Platform
from heteroserve.worker.model_runner import kv_cache_dtype

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

"""The operator table's fallback rules and platform selection errors, without a model."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from heteroserve.platforms import BUILTIN_PLATFORMS, detect_platforms, resolve_platform
from heteroserve.platforms.cpu.platform import CpuPlatform
from heteroserve.platforms.operators import CPU_FALLBACK, OPERATORS, LinearOp, OperatorTable, means_unsupported
from heteroserve.platforms.reference_ops import rms_norm


def _raises(exc: BaseException):
    def kernel(*args):
        raise exc

    return kernel


def test_missing_kernel_runs_the_reference_logs_once_and_counts(caplog):
    table = OperatorTable(LinearOp(), {})
    x, w = torch.randn(3, 8), torch.randn(8)
    with caplog.at_level(logging.WARNING, logger="heteroserve.platforms.operators"):
        first = table.rms_norm(x, w, 1e-6)
        table.rms_norm(x, w, 1e-6)
    assert torch.equal(first, rms_norm(x, w, 1e-6))
    assert table.fallbacks == {"rms_norm": 2}
    assert [r.getMessage() for r in caplog.records] == [
        "operator rms_norm runs on the CPU (reference implementation): the platform has no kernel for it"
    ]
    assert table.describe()["rms_norm"] == CPU_FALLBACK


@pytest.mark.parametrize(
    "exc",
    [
        NotImplementedError("no kernel"),
        RuntimeError("\"silu_cpu\" not implemented for 'Half'"),
        RuntimeError("op is unsupported"),
    ],
)
def test_unsupported_errors_fall_back(exc):
    table = OperatorTable(LinearOp(), {"silu_and_mul": _raises(exc)})
    x = torch.randn(2, 6)
    assert torch.equal(table.silu_and_mul(x), torch.nn.functional.silu(x[:, :3]) * x[:, 3:])
    assert table.fallbacks == {"silu_and_mul": 1}


def test_other_errors_propagate():
    table = OperatorTable(LinearOp(), {"silu_and_mul": _raises(RuntimeError("device out of memory"))})
    with pytest.raises(RuntimeError, match="out of memory"):
        table.silu_and_mul(torch.randn(2, 6))
    assert not means_unsupported(ValueError("not implemented"))


def test_in_place_operator_falls_back_into_the_callers_cache():
    table = OperatorTable(LinearOp(), {"write_kv": _raises(NotImplementedError())})
    k_cache, v_cache = torch.zeros(2, 4, 1, 2), torch.zeros(2, 4, 1, 2)
    k, v = torch.ones(2, 1, 2), 2 * torch.ones(2, 1, 2)
    table.write_kv(k, v, k_cache, v_cache, torch.tensor([1, 6]))
    assert k_cache.view(-1, 2)[[1, 6]].eq(1).all() and v_cache.view(-1, 2)[[1, 6]].eq(2).all()
    assert k_cache.sum() == 4


def test_unknown_operator_names_are_rejected():
    with pytest.raises(ValueError, match="unknown operators \\['flash'\\]"):
        OperatorTable(LinearOp(), {"flash": lambda: None})


def test_platform_table_counts_into_the_platform():
    platform = CpuPlatform()
    platform.unsupported_operators = frozenset({"rotary"})
    table = platform.operator_table(torch.float32)
    assert set(table.kernels) == set(OPERATORS) - {"rotary"}
    q, k = torch.randn(2, 2, 4), torch.randn(2, 1, 4)
    cos, sin = torch.randn(8, 4), torch.randn(8, 4)
    table.rotary(torch.tensor([0, 5]), q, k, cos, sin)
    assert platform.operator_fallbacks == {"rotary": 1}


def test_selection_errors_name_what_is_available(monkeypatch):
    monkeypatch.delenv("HETEROSERVE_DEVICE", raising=False)
    assert detect_platforms()[-1].name == "cpu"
    with pytest.raises(ValueError, match="unknown device 'tpu'; known: .*cuda.*npu.*; available: .*cpu"):
        resolve_platform("tpu")
    if not BUILTIN_PLATFORMS["npu"].is_available():
        with pytest.raises(ValueError, match="device 'npu' is not available here.*available: .*cpu"):
            resolve_platform("npu")
    monkeypatch.setenv("HETEROSERVE_DEVICE", "cpu")
    assert resolve_platform().name == "cpu"


def test_vendor_detection_without_the_extension_is_a_plain_no():
    """Without torch_npu / torch_mlu installed, detection answers False rather than raising ImportError."""
    for name in ("npu", "mlu"):
        cls = BUILTIN_PLATFORMS[name]
        if importlib.util.find_spec(cls.vendor_extension) is None:
            assert cls.is_available() is False

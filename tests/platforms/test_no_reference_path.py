"""No silent slow path: on a CPU whose kernels load (every x86-64 level and aarch64), no projection of the default
model, 4-bit as shipped or float32, runs the torch reference; where a format is left to the reference, the
start-up log says so at WARNING, `heteroserve env`'s operator list names it with the reason, and its calls are
counted for the metrics."""

from __future__ import annotations

import logging

import pytest
import torch

from heteroserve import LLM, SamplingParams
from heteroserve.platforms.cpu import kernels as cpu_kernels
from heteroserve.platforms.cpu.int4 import CpuInt4Weight
from heteroserve.platforms.cpu.int8 import CpuGroupedInt8Weight
from heteroserve.platforms.cpu.packed import CpuPackedWeight
from heteroserve.platforms.cpu.platform import CpuLinear
from heteroserve.platforms.operators import REFERENCE_LINEAR, OperatorTable
from heteroserve.quantization.int4 import Int4Weight, quantize_int4

KERNEL_FORMATS = (CpuInt4Weight, CpuPackedWeight, CpuGroupedInt8Weight)


@pytest.mark.parametrize("quantization", [None, "none"], ids=["as-shipped", "float32"])
def test_every_projection_of_the_default_model_runs_a_kernel(quantization):
    if not cpu_kernels.load_library():
        pytest.skip("the C++ kernels cannot be built here (CI requires them: test_kernels_required.py)")
    llm = LLM(max_model_len=256, kv_cache_memory_bytes=32 * 1024**2, quantization=quantization)
    model = llm.engine.executor.worker.runner.model
    projections = {"lm_head": model.lm_head}
    for i, layer in enumerate(model.layers):
        projections.update(
            {
                f"{i}.qkv": layer.self_attn.qkv_proj,
                f"{i}.o": layer.self_attn.o_proj,
                f"{i}.gate_up": layer.gate_up_proj,
                f"{i}.down": layer.down_proj,
            }
        )
    slow = {name: type(w).__name__ for name, w in projections.items() if not isinstance(w, KERNEL_FORMATS)}
    assert not slow, f"projections on the reference: {slow}"
    if quantization is None:
        assert isinstance(model.layers[0].gate_up_proj, CpuInt4Weight)
    llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert dict(llm.engine.platform.operator_fallbacks) == {}
    assert model.linear.reference_formats == {}


def test_a_format_left_to_the_reference_is_said_listed_and_counted(caplog):
    linear = CpuLinear(torch.float32, int4_kernel=False)
    table = OperatorTable(linear, {})
    weight = quantize_int4(torch.randn(64, 128))
    with caplog.at_level(logging.WARNING, logger="heteroserve.platforms.operators"):
        prepared = linear.prepare(weight)
        linear.prepare(quantize_int4(torch.randn(64, 128)))
    assert isinstance(prepared, Int4Weight)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "int4 weights run the torch reference (dequantised on every product): the C++ kernels are not loaded"
    ]
    assert table.describe()["linear int4"] == f"{REFERENCE_LINEAR}: the C++ kernels are not loaded"
    x = torch.randn(3, 128)
    torch.testing.assert_close(linear(x, prepared), x @ weight.dequantize().T)
    linear(x, prepared)
    assert table.fallbacks == {"linear int4": 2}

"""Every loaded weight format implements the compressed-weight protocol: its product and its shards agree with
the same operations on its dequantised tensor."""

from __future__ import annotations

import pytest
import torch

from heteroserve.quantization import CompressedWeight, Int4Weight, Int8Weight, PermutedInput, ShardableWeight

N, K, GROUP = 8, 64, 32


def _int4() -> Int4Weight:
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (N, K), generator=gen)
    return Int4Weight.from_values(q, torch.rand(N, K // GROUP, generator=gen), torch.randn(N, K // GROUP), GROUP)


def _int8_asymmetric() -> Int8Weight:
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
    return Int8Weight(q, torch.rand(N, K // GROUP, generator=gen), GROUP, torch.randn(N, K // GROUP, generator=gen))


def _act_order() -> PermutedInput:
    return PermutedInput(_int4(), torch.randperm(K, generator=torch.Generator().manual_seed(2)))


FORMATS = {"int4": _int4, "int8 with zeros": _int8_asymmetric, "act-order int4": _act_order}


@pytest.mark.parametrize("name", list(FORMATS))
def test_matmul_is_the_dequantised_product(name):
    weight = FORMATS[name]()
    assert isinstance(weight, CompressedWeight) and isinstance(weight, ShardableWeight)
    x, bias = torch.randn(3, K), torch.randn(N)
    expected = x @ weight.dequantize().T + bias
    torch.testing.assert_close(weight.matmul(x, bias), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(FORMATS))
def test_row_shards_are_the_dequantised_rows(name):
    weight = FORMATS[name]()
    torch.testing.assert_close(weight.slice_rows(2, 6).dequantize(), weight.dequantize()[2:6])


@pytest.mark.parametrize("name", ["int4", "int8 with zeros"])
def test_column_shards_split_at_group_borders_only(name):
    weight = FORMATS[name]()
    torch.testing.assert_close(weight.slice_columns(GROUP, K).dequantize(), weight.dequantize()[:, GROUP:])
    with pytest.raises(ValueError, match="cannot be split at column 16"):
        weight.slice_columns(0, 16)


def test_act_order_weights_refuse_column_shards():
    with pytest.raises(ValueError, match="cannot be split by column"):
        _act_order().slice_columns(0, GROUP)

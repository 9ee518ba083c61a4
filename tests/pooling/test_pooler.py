"""The pooler on hand-made hidden states: pooling types, per-request settings in one step, classifier tasks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from heteroserve.model.layers.pooler import ClassifierHead, DenseLayer, Pooler, PoolerSpec
from heteroserve.pooling_params import PoolingParams

SEQ_LENS = [3, 1, 5]


def hidden() -> torch.Tensor:
    return torch.randn(sum(SEQ_LENS), 8, generator=torch.Generator().manual_seed(0))


def rows_of(x: torch.Tensor) -> list[torch.Tensor]:
    return list(x.split(SEQ_LENS))


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("CLS", lambda r: r[0]), ("LAST", lambda r: r[-1]), ("MEAN", lambda r: r.mean(0))],
)
def test_pooling_types(kind, expected):
    h = hidden()
    pooler = Pooler(PoolerSpec("embed", kind, normalize=False, embedding_size=8))
    out = pooler.pool(h, SEQ_LENS, [PoolingParams()] * 3)
    for ours, rows in zip(out, rows_of(h), strict=True):
        assert ours.dtype == torch.float32 and ours.device.type == "cpu"
        torch.testing.assert_close(ours, expected(rows))


def test_dense_then_per_request_cut_and_normalisation():
    h = hidden()
    gen = torch.Generator().manual_seed(1)
    dense = DenseLayer(torch.randn(6, 8, generator=gen), torch.randn(6, generator=gen), "tanh")
    pooler = Pooler(PoolerSpec("embed", "MEAN", normalize=True, embedding_size=6, matryoshka_dimensions=()), [dense])
    params = [PoolingParams(dimensions=4), PoolingParams(normalize=False), PoolingParams(dimensions=2, normalize=False)]
    out = pooler.pool(h, SEQ_LENS, params)
    full = torch.stack([torch.tanh(F.linear(r.mean(0), dense.weight, dense.bias)) for r in rows_of(h)])
    torch.testing.assert_close(out[0], F.normalize(full[0, :4], dim=0))
    torch.testing.assert_close(out[1], full[1])
    torch.testing.assert_close(out[2], full[2, :2])


def test_score_and_classify_in_one_step():
    h = hidden()
    gen = torch.Generator().manual_seed(2)
    head = ClassifierHead(
        DenseLayer(torch.randn(3, 8, generator=gen), torch.randn(3, generator=gen)),
        DenseLayer(torch.randn(8, 8, generator=gen), torch.randn(8, generator=gen), "tanh"),
    )
    spec = PoolerSpec("score", "CLS", normalize=False, embedding_size=8, num_labels=3, activation="identity")
    params = [PoolingParams("score"), PoolingParams("classify"), PoolingParams("classify")]
    out = Pooler(spec, head=head).pool(h, SEQ_LENS, params)
    logits = [head(r[0][None])[0] for r in rows_of(h)]
    torch.testing.assert_close(out[0], logits[0])
    torch.testing.assert_close(out[1], logits[1].softmax(0))
    torch.testing.assert_close(out[2], logits[2].softmax(0))
    assert out[1].sum().item() == pytest.approx(1.0)


def test_score_model_needs_a_head():
    with pytest.raises(ValueError, match="classifier head"):
        Pooler(PoolerSpec("score", "CLS", normalize=False, embedding_size=8, num_labels=1))

"""Session fixtures: each tiny pooling checkpoint built once (tests/pooling/tiny_pooling_models.py)."""

from __future__ import annotations

import pytest

from tests.pooling.tiny_pooling_models import (
    TinyPoolingModel,
    build_bert_cross_encoder,
    build_bert_embedder,
    build_chat_embedder,
    build_qwen3_embedder,
    build_xlmr_cross_encoder,
)


@pytest.fixture(scope="session")
def bert_embedder(tmp_path_factory) -> TinyPoolingModel:
    return build_bert_embedder(tmp_path_factory.mktemp("pooling") / "bert_embedder")


@pytest.fixture(scope="session")
def xlmr_cross_encoder(tmp_path_factory) -> TinyPoolingModel:
    return build_xlmr_cross_encoder(tmp_path_factory.mktemp("pooling") / "xlmr_cross_encoder")


@pytest.fixture(scope="session")
def bert_cross_encoder(tmp_path_factory) -> TinyPoolingModel:
    return build_bert_cross_encoder(tmp_path_factory.mktemp("pooling") / "bert_cross_encoder")


@pytest.fixture(scope="session")
def qwen3_embedder(tmp_path_factory) -> TinyPoolingModel:
    return build_qwen3_embedder(tmp_path_factory.mktemp("pooling") / "qwen3_embedder")


@pytest.fixture(scope="session")
def chat_embedder(tmp_path_factory) -> TinyPoolingModel:
    return build_chat_embedder(tmp_path_factory.mktemp("pooling") / "chat_embedder")

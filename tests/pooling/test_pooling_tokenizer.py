"""Pooling texts tokenized as sentence-transformers tokenizes them (heteroserve.engine.pooling_tokenizer.py), checked
against sentence-transformers 6 on checkpoints it saved: texts through the chat template of a "message" modality,
the default prompt, truncation that restores the template's closing tokens, a cross-encoder's pair as query and
document messages. The model runs directly (tests/pooling/direct.py), so each check costs no engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import CrossEncoder, SentenceTransformer

from heteroserve.config import ModelConfig
from heteroserve.engine.pooling_tokenizer import PoolingTokenizer
from heteroserve.model.loader import LoadedModel, load_model
from heteroserve.platforms import resolve_platform
from heteroserve.pooling_params import PoolingParams
from tests.pooling.direct import hidden_states
from tests.pooling.tiny_pooling_models import (
    QWEN3_PROMPTS,
    TinyPoolingModel,
    build_chat_cross_encoder,
    sample_pairs,
    sample_texts,
)

TEXTS = sample_texts(31, 6)
MIN_COSINE = 0.99999


@pytest.fixture(scope="module")
def chat_cross_encoder(tmp_path_factory) -> TinyPoolingModel:
    return build_chat_cross_encoder(tmp_path_factory.mktemp("pooling") / "chat_cross_encoder")


def load(folder: Path) -> LoadedModel:
    return load_model(ModelConfig(str(folder)), resolve_platform("cpu"), "auto")


def pooling_tokenizer(loaded: LoadedModel) -> PoolingTokenizer:
    return PoolingTokenizer(loaded.tokenizer, loaded.pooler.spec, loaded.max_model_len)


def copy_with(tiny: TinyPoolingModel, tmp_path: Path, file: str, **values) -> Path:
    """A copy of the checkpoint with values set in one of its JSON files."""
    folder = Path(shutil.copytree(tiny.folder, tmp_path / tiny.name))
    path = folder / file
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))
    return folder


def st_ids(features: dict) -> list[list[int]]:
    """sentence-transformers' padded batch as each row's real tokens."""
    rows = zip(features["input_ids"], features["attention_mask"], strict=True)
    return [ids[mask.bool()].tolist() for ids, mask in rows]


def pooled(loaded: LoadedModel, encoded: list[dict[str, list[int]]], params: PoolingParams) -> torch.Tensor:
    """The model's results on these token ids, all in one forward pass."""
    rows = [{"input_ids": list(e["input_ids"]), "token_type_ids": [0] * len(e["input_ids"])} for e in encoded]
    hidden = hidden_states(loaded, rows)
    return torch.stack(loaded.pooler.pool(hidden, [len(r["input_ids"]) for r in rows], [params] * len(rows)))


def test_the_checkpoints_have_a_message_modality(chat_embedder, chat_cross_encoder):
    """What sentence-transformers 6 writes for a tokenizer with a chat template, and what the loader reads of it."""
    for tiny in (chat_embedder, chat_cross_encoder):
        modalities = json.loads((tiny.folder / "sentence_bert_config.json").read_text())["modality_config"]
        assert set(modalities) == {"text", "message"} and modalities["message"]["format"] == "flat"
        chat = load(tiny.folder).pooler.spec.chat_template
        assert chat is not None and not chat.structured and chat.restore_suffix and chat.template_kwargs == {}


@pytest.mark.parametrize("template_kwargs", [{}, {"add_generation_prompt": True}])
def test_texts_are_rendered_as_user_messages(chat_embedder, tmp_path, template_kwargs):
    folder = copy_with(
        chat_embedder, tmp_path, "sentence_bert_config.json", processing_kwargs={"chat_template": template_kwargs}
    )
    st = SentenceTransformer(str(folder), device="cpu")
    reference = st.encode(TEXTS, convert_to_tensor=True)
    loaded = load(folder)
    encoded = [pooling_tokenizer(loaded).text(text, None) for text in TEXTS]
    assert [e["input_ids"] for e in encoded] == st_ids(st.preprocess(TEXTS))
    assert F.cosine_similarity(pooled(loaded, encoded, PoolingParams()), reference).min() >= MIN_COSINE


@pytest.mark.parametrize("name", ["chat_embedder", "qwen3_embedder"])
def test_the_default_prompt_applies_to_every_text(name, request, tmp_path):
    """default_prompt_name: a system message before a chat template's user message, else a prefix of the text."""
    tiny = request.getfixturevalue(name)
    plain = SentenceTransformer(str(tiny.folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    folder = copy_with(tiny, tmp_path, "config_sentence_transformers.json", default_prompt_name="query")
    reference = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    assert F.cosine_similarity(plain, reference).max() < 0.999  # the prompt changes the embeddings
    loaded = load(folder)
    assert loaded.pooler.spec.default_prompt == QWEN3_PROMPTS["query"]
    encoded = [pooling_tokenizer(loaded).text(text, None) for text in TEXTS]
    assert F.cosine_similarity(pooled(loaded, encoded, PoolingParams()), reference).min() >= MIN_COSINE


def test_truncation_restores_the_template_suffix(chat_embedder):
    """Cut at 10 tokens, a rendered text ends with the template's closing `<|im_end|>\\n` again, as
    sentence-transformers truncates at max_seq_length; the last token, which is pooled, is the same marker."""
    st = SentenceTransformer(str(chat_embedder.folder), device="cpu")
    st.max_seq_length = 10
    reference = st_ids(st.preprocess(TEXTS))
    tokenizer = pooling_tokenizer(load(chat_embedder.folder))
    ours = [list(tokenizer.text(text, 10)["input_ids"]) for text in TEXTS]
    assert ours == reference
    closing = st.tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert all(len(ids) == 10 and ids[-len(closing) :] == closing for ids in ours)


def test_cross_encoder_pairs_are_query_and_document_messages(chat_cross_encoder):
    pairs = sample_pairs(32, 6)
    cross_encoder = CrossEncoder(str(chat_cross_encoder.folder), device="cpu")
    reference = torch.as_tensor(cross_encoder.predict(pairs))
    loaded = load(chat_cross_encoder.folder)
    encoded = [pooling_tokenizer(loaded).pair(query, document, None) for query, document in pairs]
    assert [e["input_ids"] for e in encoded] == st_ids(cross_encoder.preprocess(pairs))
    scores = pooled(loaded, encoded, PoolingParams(task="score"))[:, 0]
    assert reference.std() > 0.05 and (scores - reference).abs().max() < 1e-5


def test_a_template_that_drops_a_pair_role_is_refused(chat_cross_encoder, tmp_path):
    folder = Path(shutil.copytree(chat_cross_encoder.folder, tmp_path / "user_only"))
    user_only = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    (folder / "chat_template.jinja").write_text(user_only)
    with pytest.raises(ValueError, match="does not render the query and document message of a pair"):
        pooling_tokenizer(load(folder)).pair("where is the river", "The river runs north.", None)


def test_a_message_modality_without_a_chat_template_is_refused(chat_embedder, tmp_path):
    folder = Path(shutil.copytree(chat_embedder.folder, tmp_path / "no_template"))
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="message modality .* the tokenizer has no chat template"):
        pooling_tokenizer(load(folder))

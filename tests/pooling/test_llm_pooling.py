"""The offline pooling API (LLM.embed / score / classify / encode) on tiny random checkpoints, against
sentence-transformers and transformers on the same weights, float32."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from heteroserve.entrypoints.llm import LLM
from heteroserve.pooling_params import PoolingParams
from heteroserve.sampling_params import SamplingParams
from tests.pooling.tiny_pooling_models import (
    _encoder_config,
    _save_cross_encoder,
    bert_tokenizer,
    randomize_encoder,
    sample_pairs,
    sample_texts,
)

COSINE = 0.99999


def cosines(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(ours.double(), theirs.double(), dim=1)


def embeddings(llm: LLM, texts: list[str], **kwargs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False, **kwargs)])


def spread(vectors: torch.Tensor) -> float:
    """The largest cosine between two different texts' embeddings: far below 1 unless outputs are degenerate."""
    unit = torch.nn.functional.normalize(vectors.double(), dim=1)
    similarity = unit @ unit.T
    return float((similarity - 2 * torch.eye(len(vectors))).max())


@pytest.fixture(scope="module")
def bert_llm(bert_embedder):
    llm = LLM(str(bert_embedder.folder))
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("name", ["bert_embedder", "qwen3_embedder"])
def test_embeddings_match_sentence_transformers(name, request):
    model = request.getfixturevalue(name)
    texts = sample_texts(3, 12)
    reference = SentenceTransformer(str(model.folder), device="cpu").encode(texts, convert_to_tensor=True)
    llm = LLM(str(model.folder))
    try:
        assert llm.engine.model.task == "embed" and llm.engine.model.pooler_spec.pooling_type == model.pooling_type
        ours = embeddings(llm, texts)
        assert llm.engine.scheduler.kv_cache.pool.num_used_blocks == 0
    finally:
        llm.shutdown()
    similarity = cosines(ours, reference)
    print(
        f"{name}: min cosine {similarity.min():.8f}, max |diff| {(ours - reference).abs().max():.2e}, "
        f"largest cosine between different texts {spread(reference):.3f}"
    )
    assert spread(reference) < 0.98  # mean-pooled BERT vectors of different texts stay apart
    assert similarity.min() >= COSINE
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(texts)), atol=1e-5)


def test_chat_template_embedder_matches_sentence_transformers(chat_embedder):
    """sentence-transformers 6 saved this decoder embedder with a "message" modality (its tokenizer has a chat
    template), so `encode` renders each text as a user message through the template: LLM.embed must too, whole
    and truncated (where the template's closing tokens are put back)."""
    modalities = json.loads((chat_embedder.folder / "sentence_bert_config.json").read_text())["modality_config"]
    assert "message" in modalities
    texts = sample_texts(3, 12)
    st = SentenceTransformer(str(chat_embedder.folder), device="cpu")
    reference = st.encode(texts, convert_to_tensor=True)
    st.max_seq_length = 8
    truncated_reference = st.encode(texts, convert_to_tensor=True)
    llm = LLM(str(chat_embedder.folder))
    try:
        ours = embeddings(llm, texts)
        truncated = embeddings(llm, texts, truncate_prompt_tokens=8)
    finally:
        llm.shutdown()
    whole, cut = cosines(ours, reference).min(), cosines(truncated, truncated_reference).min()
    print(f"chat_embedder: min cosine {whole:.8f}, truncated to 8 tokens {cut:.8f}")
    assert spread(reference) < 0.98
    assert whole >= COSINE and cut >= COSINE


def test_mixed_length_batch_equals_one_at_a_time(bert_llm):
    texts = sample_texts(5, 10, min_words=1, max_words=60)
    together = embeddings(bert_llm, texts)
    alone = torch.cat([embeddings(bert_llm, [text]) for text in texts])
    assert (together - alone).abs().max() < 1e-5


def test_token_ids_and_text_give_the_same_embedding(bert_llm, bert_embedder):
    text = sample_texts(6, 1)[0]
    ids = AutoTokenizer.from_pretrained(bert_embedder.folder)(text)["input_ids"]
    by_text, by_ids = embeddings(bert_llm, [text]), embeddings(bert_llm, [{"prompt_token_ids": ids}])
    assert torch.equal(by_text, by_ids)


def test_matryoshka_dimensions_cut_then_normalise(bert_llm, bert_embedder):
    texts = sample_texts(7, 4)
    full = SentenceTransformer(str(bert_embedder.folder), device="cpu").encode(texts, convert_to_tensor=True)
    expected = torch.nn.functional.normalize(full[:, :16], dim=1)
    ours = embeddings(bert_llm, texts, pooling_params=PoolingParams(dimensions=16))
    assert ours.shape == (4, 16)
    assert cosines(ours, expected).min() >= COSINE
    assert torch.allclose(ours.norm(dim=1), torch.ones(4), atol=1e-5)
    with pytest.raises(ValueError, match="dimensions 20 is not one of"):
        bert_llm.embed(texts, pooling_params=PoolingParams(dimensions=20))


def test_normalize_false_returns_the_raw_pooled_vector(bert_llm, bert_embedder):
    texts = sample_texts(8, 3)
    normalised = embeddings(bert_llm, texts)
    raw = embeddings(bert_llm, texts, pooling_params=PoolingParams(normalize=False))
    assert (raw.norm(dim=1) - 1).abs().min() > 1e-3
    assert torch.allclose(torch.nn.functional.normalize(raw, dim=1), normalised, atol=1e-6)


def test_pooler_config_overrides_the_checkpoint(bert_embedder):
    texts = sample_texts(9, 3)
    st = SentenceTransformer(str(bert_embedder.folder), device="cpu")
    tokens = st.tokenize(texts)
    with torch.no_grad():
        hidden = st[0].auto_model(**tokens).last_hidden_state
    expected = torch.nn.functional.normalize(hidden[:, 0], dim=1)  # CLS instead of the checkpoint's mean
    llm = LLM(str(bert_embedder.folder), pooler_config={"pooling_type": "CLS"})
    try:
        assert cosines(embeddings(llm, texts), expected).min() >= COSINE
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", ["xlmr_cross_encoder", "bert_cross_encoder"])
def test_cross_encoder_scores_match_sentence_transformers(name, request):
    model = request.getfixturevalue(name)
    pairs = sample_pairs(4, 8)
    reference = torch.tensor(CrossEncoder(str(model.folder), device="cpu").predict(pairs))
    llm = LLM(str(model.folder))
    try:
        assert llm.engine.model.task == "score"
        ours = torch.tensor([o.outputs.score for o in llm.score([q for q, _ in pairs], [d for _, d in pairs])])
        one_to_many = torch.tensor([o.outputs.score for o in llm.score(pairs[0][0], [d for _, d in pairs])])
        expected_one = torch.tensor(
            CrossEncoder(str(model.folder), device="cpu").predict([(pairs[0][0], d) for _, d in pairs])
        )
    finally:
        llm.shutdown()
    print(f"{name}: max |diff| {(ours - reference).abs().max():.2e}, reference scores {reference.tolist()}")
    assert reference.std() > 0.05  # the scores differ between pairs
    assert (ours - reference).abs().max() < 1e-5
    assert (one_to_many - expected_one).abs().max() < 1e-5


def test_score_with_an_embedding_model_is_cosine_similarity(bert_llm, bert_embedder):
    query, documents = "where is the river", sample_texts(10, 4)
    st = SentenceTransformer(str(bert_embedder.folder), device="cpu")
    vectors = st.encode([query, *documents], convert_to_tensor=True)
    expected = torch.nn.functional.cosine_similarity(vectors[:1], vectors[1:], dim=1)
    ours = torch.tensor([o.outputs.score for o in bert_llm.score(query, documents)])
    assert (ours - expected).abs().max() < 1e-5


def test_classify_gives_label_probabilities(tmp_path):
    tokenizer = bert_tokenizer()
    config = _encoder_config("bert", len(tokenizer), max_position_embeddings=64, num_labels=3)
    torch.manual_seed(5)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    randomize_encoder(model, 5)
    _save_cross_encoder(model, tokenizer, tmp_path)
    texts = sample_texts(11, 4)
    with torch.no_grad():
        expected = torch.softmax(model.eval()(**tokenizer(texts, return_tensors="pt", padding=True)).logits, -1)
    llm = LLM(str(tmp_path))
    try:
        ours = torch.tensor([o.outputs.probs for o in llm.classify(texts, use_tqdm=False)])
    finally:
        llm.shutdown()
    assert ours.shape == (4, 3)
    assert (ours - expected).abs().max() < 1e-5


def test_bad_requests_are_refused_before_anything_runs(bert_llm, bert_embedder):
    with pytest.raises(ValueError, match="the prompt is empty"):
        bert_llm.embed([{"prompt_token_ids": []}])
    too_long = " ".join(["river"] * (bert_embedder.max_model_len + 10))
    with pytest.raises(ValueError, match="more than max_model_len"):
        bert_llm.embed([too_long])
    assert len(bert_llm.embed([too_long], truncate_prompt_tokens=-1)[0].outputs.embedding) == 64
    with pytest.raises(ValueError, match="embedding model"):
        bert_llm.encode(["a"], PoolingParams(task="score"))
    with pytest.raises(ValueError, match="pooling model"):
        bert_llm.generate(["a"], SamplingParams(max_tokens=2))
    assert not bert_llm.engine.has_unfinished_requests()


def test_generate_model_refuses_pooling(default_llm):
    with pytest.raises(ValueError, match="generates text"):
        default_llm.embed(["hello"])


def test_unknown_pooler_config_key_is_refused(bert_embedder):
    with pytest.raises(ValueError, match="unknown pooler_config keys: pooling"):
        LLM(str(bert_embedder.folder), pooler_config={"pooling": "MEAN"})


def test_do_lower_case_lowercases_texts_as_sentence_transformers_does(qwen3_embedder, tmp_path):
    folder = tmp_path / "lowercased"
    shutil.copytree(qwen3_embedder.folder, folder)
    config_path = folder / "sentence_bert_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "do_lower_case": True}))
    texts = ["The River Flows NORTH", "Where Is The Old Bridge"]
    reference = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True)
    cased = SentenceTransformer(str(qwen3_embedder.folder), device="cpu").encode(texts, convert_to_tensor=True)
    assert cosines(reference, cased).max() < 0.999  # the case changes the tokens, so the check below means something
    llm = LLM(str(folder))
    try:
        assert cosines(embeddings(llm, texts), reference).min() >= COSINE
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name,parallel", [("bert_embedder", "tensor"), ("qwen3_embedder", "pipeline")])
def test_parallelism_is_refused_for_pooling_models_before_workers_start(name, parallel, request):
    model = request.getfixturevalue(name)
    with pytest.raises(ValueError, match="pooling models .* run on one rank"):
        LLM(str(model.folder), **{f"{parallel}_parallel_size": 2})

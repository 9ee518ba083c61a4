"""The pooling models against sentence-transformers on the same texts: encoders (BERT, XLM-R), a Qwen3 embedder
on the decoder, one forward pass over mixed lengths, quantised weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import CrossEncoder, SentenceTransformer

from heteroserve.config import ModelConfig
from heteroserve.model.loader import LoadedModel, load_model
from heteroserve.model.loader.encoder_weights import ENCODER_PROJECTIONS
from heteroserve.platforms import resolve_platform
from heteroserve.pooling_params import PoolingParams
from tests.pooling.direct import hidden_states, pooled, tokenize
from tests.pooling.tiny_pooling_models import TinyPoolingModel, sample_pairs, sample_texts

TEXTS = sample_texts(0, 8)
PAIRS = sample_pairs(1, 8)
MIN_COSINE = 0.99999
MAX_ABS = 2e-5  # float32 against float32, different kernels and summation orders


def load(tiny: TinyPoolingModel, kernels: str = "auto", **config) -> LoadedModel:
    return load_model(ModelConfig(str(tiny.folder), **config), resolve_platform("cpu"), kernels)


def st_embeddings(tiny: TinyPoolingModel, texts: list[str], **kwargs) -> torch.Tensor:
    return SentenceTransformer(str(tiny.folder), device="cpu").encode(texts, convert_to_tensor=True, **kwargs)


def ce_scores(tiny: TinyPoolingModel, pairs: list[tuple[str, str]]) -> torch.Tensor:
    return torch.as_tensor(CrossEncoder(str(tiny.folder), device="cpu").predict(pairs))


def assert_spread(embeddings: torch.Tensor) -> None:
    """Different texts' reference embeddings are far apart, so agreeing with them means something."""
    cosines = F.normalize(embeddings, dim=1) @ F.normalize(embeddings, dim=1).T
    off_diagonal = cosines[~torch.eye(len(embeddings), dtype=torch.bool)]
    low, mean, high = off_diagonal.min(), off_diagonal.mean(), off_diagonal.max()
    print(f"reference pairwise cosine: min {low:.3f} mean {mean:.3f} max {high:.3f}")
    assert mean < 0.8 and high < 0.97


def assert_embeddings_match(ours: torch.Tensor, reference: torch.Tensor, min_cosine: float = MIN_COSINE) -> None:
    cosine = F.cosine_similarity(ours, reference, dim=1)
    error = (ours - reference).abs().max()
    print(f"cosine to reference >= {cosine.min():.7f}, max abs difference {error:.2e}")
    assert cosine.min() >= min_cosine
    if min_cosine == MIN_COSINE:
        assert error <= MAX_ABS


@pytest.mark.parametrize("kernels", ["reference", "auto"])
def test_bert_embedder_matches_sentence_transformers(bert_embedder, kernels):
    loaded = load(bert_embedder, kernels)
    reference = st_embeddings(bert_embedder, TEXTS)
    assert_spread(reference)
    assert_embeddings_match(pooled(loaded, TEXTS, PoolingParams()), reference)


@pytest.mark.parametrize("kernels", ["reference", "auto"])
def test_qwen3_embedder_matches_sentence_transformers(qwen3_embedder, kernels):
    """Last-token pooling on the decoder (Qwen3-Embedding's layout), with and without its query prompt."""
    loaded = load(qwen3_embedder, kernels)
    reference = st_embeddings(qwen3_embedder, TEXTS)
    assert_spread(reference)
    assert_embeddings_match(pooled(loaded, TEXTS, PoolingParams()), reference)
    prompt = loaded.pooler.spec.prompts["query"]
    queries = pooled(loaded, [prompt + text for text in TEXTS], PoolingParams())
    assert_embeddings_match(queries, st_embeddings(qwen3_embedder, TEXTS, prompt_name="query"))


@pytest.mark.parametrize("name", ["bert_cross_encoder", "xlmr_cross_encoder"])
@pytest.mark.parametrize("kernels", ["reference", "auto"])
def test_cross_encoders_match_sentence_transformers(name, kernels, request):
    tiny = request.getfixturevalue(name)
    loaded = load(tiny, kernels)
    reference = ce_scores(tiny, PAIRS)
    print(f"reference scores: {reference.min():.3f}..{reference.max():.3f}, std {reference.std():.3f}")
    assert reference.std() > 0.03 and reference.max() - reference.min() > 0.1
    ours = pooled(loaded, PAIRS, PoolingParams(task="score"))
    assert ours.shape == (len(PAIRS), 1)
    error = (ours[:, 0] - reference).abs().max()
    print(f"max abs difference {error:.2e}")
    assert error <= MAX_ABS


def test_bert_pair_token_types_matter(bert_cross_encoder):
    """BERT reads a pair's second text with token type 1: with types all 0 the scores leave the reference."""
    loaded = load(bert_cross_encoder)
    reference = ce_scores(bert_cross_encoder, PAIRS)
    encoded = tokenize(loaded, PAIRS)
    assert all(1 in e["token_type_ids"] for e in encoded)
    seq_lens = [len(e["input_ids"]) for e in encoded]
    params = [PoolingParams(task="score")] * len(PAIRS)
    with_types = torch.stack(loaded.pooler.pool(hidden_states(loaded, encoded), seq_lens, params))[:, 0]
    for e in encoded:
        e["token_type_ids"] = [0] * len(e["input_ids"])
    without = torch.stack(loaded.pooler.pool(hidden_states(loaded, encoded), seq_lens, params))[:, 0]
    right, wrong = (with_types - reference).abs().max(), (without - reference).abs().max()
    print(f"max abs difference with token types {right:.2e}, with all 0 {wrong:.2e}")
    assert right <= MAX_ABS and wrong > 1e-3


@pytest.mark.parametrize("name", ["bert_embedder", "xlmr_cross_encoder", "qwen3_embedder"])
def test_mixed_lengths_in_one_forward_equal_each_alone(name, request):
    """Each sequence attends to its own tokens only, whatever else shares the step."""
    loaded = load(request.getfixturevalue(name))
    texts = sample_texts(2, 9, 1, 40) + [TEXTS[0], TEXTS[0]]  # equal lengths too: one mask shared
    encoded = tokenize(loaded, texts)
    lengths = [len(e["input_ids"]) for e in encoded]
    together = hidden_states(loaded, encoded)
    alone = torch.cat([hidden_states(loaded, [e]) for e in encoded])
    scale = float(alone.abs().max())
    print(f"lengths {lengths}: max abs difference {(together - alone).abs().max():.2e} (largest |value| {scale:.1f})")
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-5 * scale)


def test_int8_load_time_quantisation_stays_close(bert_embedder, xlmr_cross_encoder):
    """Rounding each weight to 8 bits (about 0.5% noise per weight) moves these deliberately sharp random models'
    embeddings to cosine 0.98-0.998 of the float model's over seeds. What we compute from the 8-bit weights is
    checked at float32 precision against sentence-transformers running the same rounded weights."""
    embedder = load(bert_embedder, quantization="int8")
    assert type(embedder.model.layers[0].qkv_proj).__name__ != "Parameter"  # the projections were quantised
    assert embedder.model.weight_bytes() < 0.5 * load(bert_embedder).model.weight_bytes()
    ours = pooled(embedder, TEXTS, PoolingParams())
    rounded = SentenceTransformer(str(bert_embedder.folder), device="cpu")
    with torch.no_grad():
        for name, param in rounded.named_parameters():
            if name.endswith(ENCODER_PROJECTIONS):  # symmetric, one scale per output row, as `--quantization int8`
                scale = param.abs().amax(1, keepdim=True) / 127
                param.copy_((param / scale).round().clamp(-127, 127) * scale)
    assert_embeddings_match(ours, rounded.encode(TEXTS, convert_to_tensor=True))
    assert_embeddings_match(ours, st_embeddings(bert_embedder, TEXTS), 0.97)
    scorer = load(xlmr_cross_encoder, quantization="int8")
    error = (pooled(scorer, PAIRS, PoolingParams(task="score"))[:, 0] - ce_scores(xlmr_cross_encoder, PAIRS)).abs()
    print(f"int8 scores: max abs difference {error.max():.2e}")
    assert error.max() < 0.05


def test_int4_kernels_match_the_reference_on_the_same_weights(bert_embedder):
    """4-bit round-to-nearest costs these deliberately large random weights real accuracy (cosine to the float
    model ~0.75-0.93), so the check is that the CPU's 4-bit kernels compute what dequantised weights give."""
    fast = pooled(load(bert_embedder, quantization="int4"), TEXTS, PoolingParams())
    plain = pooled(load(bert_embedder, "reference", quantization="int4"), TEXTS, PoolingParams())
    assert_embeddings_match(fast, plain, 0.9999)


def test_matryoshka_cut_then_normalised(bert_embedder):
    """dimensions keeps the first values and normalises them; normalize=False returns the raw pooled vector."""
    loaded = load(bert_embedder)
    reference = st_embeddings(bert_embedder, TEXTS)
    cut = pooled(loaded, TEXTS, PoolingParams(dimensions=16))
    assert cut.shape == (len(TEXTS), 16)
    torch.testing.assert_close(cut, F.normalize(reference[:, :16], dim=1), rtol=0, atol=MAX_ABS)
    raw = pooled(loaded, TEXTS, PoolingParams(normalize=False))
    assert (raw.norm(dim=1) - 1).abs().min() > 0.01
    torch.testing.assert_close(F.normalize(raw, dim=1), reference, rtol=0, atol=MAX_ABS)
    mixed = loaded.pooler.pool(
        hidden_states(loaded, tokenize(loaded, TEXTS[:3])),
        [len(e["input_ids"]) for e in tokenize(loaded, TEXTS[:3])],
        [PoolingParams(dimensions=32), PoolingParams(), PoolingParams(dimensions=16, normalize=False)],
    )
    assert [m.shape[0] for m in mixed] == [32, 64, 16]
    torch.testing.assert_close(mixed[0], F.normalize(reference[0, :32], dim=0), rtol=0, atol=MAX_ABS)
    torch.testing.assert_close(mixed[1], reference[1], rtol=0, atol=MAX_ABS)
    torch.testing.assert_close(mixed[2], raw[2, :16], rtol=0, atol=MAX_ABS)


def test_bfloat16_activations_stay_close(bert_embedder):
    ours = pooled(load(bert_embedder, dtype="bfloat16"), TEXTS, PoolingParams())
    assert ours.dtype == torch.float32
    assert_embeddings_match(ours, st_embeddings(bert_embedder, TEXTS), 0.99)

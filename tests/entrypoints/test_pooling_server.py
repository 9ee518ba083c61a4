"""/v1/embeddings, /rerank, /v1/rerank, /score and /v1/score through real servers on tiny pooling checkpoints,
against sentence-transformers on the same weights (float32): OpenAI's client (base64 included), batches against
single inputs, Matryoshka dimensions, usage, the task each model serves, refusals and the pooling metrics."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer

from tests.conftest import EMBEDDER
from tests.entrypoints.server_process import ServerProcess
from tests.pooling.tiny_pooling_models import (
    build_bert_cross_encoder,
    build_chat_embedder,
    sample_pairs,
    sample_texts,
)

COSINE = 0.99999
SCORE_TOLERANCE = 1e-5  # a sigmoid score or a cosine, float32
CROSS_ENCODER = "tiny-reranker"
GENERATOR = "SmolLM2-135M-Instruct"
TEXTS = sample_texts(21, 7, min_words=1, max_words=60)  # from a few tokens to near max_model_len (128)


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def error(response: httpx.Response, status: int, param: str | None = None) -> str:
    """The message of an error in OpenAI's shape with this status (and param, when given)."""
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["code"] == status
    if param is not None:
        assert body["param"] == param, body
    return body["message"]


def cosines(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(ours.double(), theirs.double(), dim=-1)


@pytest.fixture(scope="module")
def st_embedder(served_embedder) -> SentenceTransformer:
    return SentenceTransformer(str(served_embedder.folder), device="cpu")


@pytest.fixture(scope="module")
def client(embedding_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{embedding_server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """The tiny BERT reranker (one label, sigmoid; token types matter) and a server on it."""
    model = build_bert_cross_encoder(tmp_path_factory.mktemp("served") / "bert_cross_encoder")
    process = ServerProcess(
        "--model", str(model.folder), "--served-model-name", CROSS_ENCODER, env={"HETEROSERVE_NUM_THREADS": "1"}
    )
    yield model, process
    process.stop()


def reference(st: SentenceTransformer, texts: list[str], **kwargs) -> torch.Tensor:
    return st.encode(texts, convert_to_tensor=True, **kwargs).float()


# -- /v1/embeddings ------------------------------------------------------------------------------------------


def test_openai_client_embeddings_float_and_base64(client, st_embedder):
    floats = client.embeddings.create(model=EMBEDDER, input=TEXTS, encoding_format="float")
    decoded = client.embeddings.create(model=EMBEDDER, input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    ours = torch.tensor([d.embedding for d in floats.data])
    assert torch.equal(torch.tensor([d.embedding for d in decoded.data]), ours)
    assert ours.shape == (len(TEXTS), 64)
    assert cosines(ours, reference(st_embedder, TEXTS)).min() >= COSINE
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)
    lengths = [len(st_embedder.tokenizer(t)["input_ids"]) for t in TEXTS]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(lengths)
    assert floats.model == EMBEDDER and floats.object == "list"


def test_base64_is_little_endian_float32(embedding_server):
    body = {"model": EMBEDDER, "input": TEXTS[:2]}
    floats = post(embedding_server, "/v1/embeddings", body).json()
    encoded = post(embedding_server, "/v1/embeddings", {**body, "encoding_format": "base64"}).json()
    for f, e in zip(floats["data"], encoded["data"], strict=True):
        values = np.frombuffer(base64.b64decode(e["embedding"]), dtype="<f4")
        assert values.tolist() == f["embedding"] and e["object"] == "embedding"
    assert encoded["id"].startswith("embd-") and encoded["usage"] == floats["usage"]


def test_mixed_length_batch_equals_one_at_a_time(client):
    batch = torch.tensor([d.embedding for d in client.embeddings.create(model=EMBEDDER, input=TEXTS).data])
    alone = torch.tensor([client.embeddings.create(model=EMBEDDER, input=t).data[0].embedding for t in TEXTS])
    assert torch.allclose(batch, alone, atol=1e-6), (batch - alone).abs().max()


def test_token_ids_give_the_same_embeddings_as_text(client, st_embedder):
    ids = [st_embedder.tokenizer(t)["input_ids"] for t in TEXTS[:3]]
    text = torch.tensor([d.embedding for d in client.embeddings.create(model=EMBEDDER, input=TEXTS[:3]).data])
    lists = client.embeddings.create(model=EMBEDDER, input=ids)
    assert torch.allclose(torch.tensor([d.embedding for d in lists.data]), text, atol=1e-6)
    assert lists.usage.prompt_tokens == sum(map(len, ids))
    one = client.embeddings.create(model=EMBEDDER, input=ids[0])
    assert torch.allclose(torch.tensor(one.data[0].embedding), text[0], atol=1e-6)


def test_matryoshka_dimensions_are_cut_then_normalised(client, st_embedder):
    for size in (16, 32):
        ours = torch.tensor(
            [d.embedding for d in client.embeddings.create(model=EMBEDDER, input=TEXTS, dimensions=size).data]
        )
        assert ours.shape == (len(TEXTS), size)
        assert cosines(ours, reference(st_embedder, TEXTS, truncate_dim=size)).min() >= COSINE
        assert torch.allclose(ours.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)


def test_truncate_prompt_tokens_cuts_as_the_tokenizer_does(embedding_server, served_embedder):
    long = " ".join(TEXTS)
    body = {"model": EMBEDDER, "input": long, "encoding_format": "float", "truncate_prompt_tokens": 16}
    answer = post(embedding_server, "/v1/embeddings", body).json()
    assert answer["usage"]["prompt_tokens"] == 16
    st = SentenceTransformer(str(served_embedder.folder), device="cpu")
    st.max_seq_length = 16
    assert cosines(torch.tensor(answer["data"][0]["embedding"]), reference(st, [long])[0]) >= COSINE


def test_normalize_false_gives_the_pooled_vector(embedding_server, served_embedder):
    body = {"model": EMBEDDER, "input": TEXTS[:2], "encoding_format": "float"}
    for flag in ("normalize", "use_activation"):
        raw = torch.tensor(
            [d["embedding"] for d in post(embedding_server, "/v1/embeddings", {**body, flag: False}).json()["data"]]
        )
        unit = torch.tensor([d["embedding"] for d in post(embedding_server, "/v1/embeddings", body).json()["data"]])
        assert (raw.norm(dim=1) - 1).abs().min() > 1e-3
        assert torch.allclose(torch.nn.functional.normalize(raw, dim=1), unit, atol=1e-5)
    conflict = post(embedding_server, "/v1/embeddings", {**body, "normalize": True, "use_activation": False})
    error(conflict, 400, "use_activation")


def test_bad_embedding_requests_answer_400(embedding_server, client):
    def refused(param: str | None = None, **fields) -> str:
        return error(post(embedding_server, "/v1/embeddings", {"model": EMBEDDER, **fields}), 400, param)

    refused("input", input=[])
    refused("input", input="")
    refused("input", input=["fine", ""])
    refused("input", input=[[]])
    refused("input")
    assert "128" in refused("input", input=" ".join(TEXTS * 3))  # past max_model_len
    assert "input[1]" in refused("input", input=["short", " ".join(TEXTS * 3)])
    refused("input", input=[1, 2, 10**6])  # beyond the vocabulary
    assert "Matryoshka" not in refused("dimensions", input="hi", dimensions=20)  # not one of 16, 32, 64
    refused("dimensions", input="hi", dimensions=65)
    refused("dimensions", input="hi", dimensions=0)
    refused("encoding_format", input="hi", encoding_format="bytes")
    refused("messages", messages=[{"role": "user", "content": "hi"}])
    refused("embed_dtype", input="hi", embed_dtype="float16")
    refused("request_id", input="hi", request_id="mine")
    refused("add_special_tokens", input="hi", add_special_tokens=False)
    assert post(embedding_server, "/v1/embeddings", {"input": "hi", "embed_dtype": "float32"}).status_code == 200
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=EMBEDDER, input=[])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="hi")


# -- the task a model serves -----------------------------------------------------------------------------------


def test_models_name_their_task(embedding_server, cross_encoder, server):
    for process, name, task in ((embedding_server, EMBEDDER, "embed"), (cross_encoder[1], CROSS_ENCODER, "score")):
        card = httpx.get(f"{process.base_url}/v1/models").json()["data"][0]
        assert card["id"] == name and card["task"] == task
        assert httpx.get(f"{process.base_url}/v1/models/{name}").json()["task"] == task
    assert httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["task"] == "generate"


def test_each_model_refuses_the_other_tasks_routes(embedding_server, cross_encoder, server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for process, task in ((embedding_server, "embed"), (cross_encoder[1], "score")):
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "hi", "max_tokens": 1})):
            message = error(post(process, path, body), 400, "model")
            assert f"(task {task})" in message and "/v1/rerank" in message and path in message
    assert "/v1/embeddings" in error(post(embedding_server, "/v1/chat/completions", chat), 400)
    assert "(task score)" in error(post(cross_encoder[1], "/v1/embeddings", {"input": "hi"}), 400, "model")
    refusals = (
        ("/v1/embeddings", {"input": "hi"}),
        ("/v1/rerank", {"query": "a", "documents": ["b"]}),
        ("/rerank", {"query": "a", "documents": ["b"]}),
        ("/score", {"text_1": "a", "text_2": "b"}),
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
    )
    for path, body in refusals:
        message = error(post(server, path, {"model": GENERATOR, **body}), 400, "model")
        assert "(task generate)" in message and "/v1/chat/completions" in message and path in message
    openai_client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="task generate"):
        openai_client.embeddings.create(model=GENERATOR, input="hi")


# -- rerank and score -------------------------------------------------------------------------------------------


def test_rerank_with_a_cross_encoder_matches_cross_encoder_predict(cross_encoder):
    model, process = cross_encoder
    query, documents = sample_pairs(5, 1)[0][0], [d for _, d in sample_pairs(6, 6)]
    expected = CrossEncoder(str(model.folder), device="cpu").predict([(query, d) for d in documents])
    assert np.ptp(expected) > 0.05  # the scores differ enough for the order to mean something
    for path in ("/v1/rerank", "/rerank"):
        answer = post(process, path, {"model": CROSS_ENCODER, "query": query, "documents": documents}).json()
        assert answer["model"] == CROSS_ENCODER and answer["id"].startswith("rerank-")
        results = answer["results"]
        assert [r["index"] for r in results] == list(np.argsort(-expected, kind="stable"))
        for r in results:
            assert r["relevance_score"] == pytest.approx(float(expected[r["index"]]), abs=SCORE_TOLERANCE)
            assert r["document"] == {"text": documents[r["index"]]}
        assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 0
    top = post(process, "/rerank", {"query": query, "documents": documents, "top_n": 2, "return_documents": False})
    assert [set(r) for r in top.json()["results"]] == [{"index", "relevance_score"}] * 2
    assert [r["index"] for r in top.json()["results"]] == list(np.argsort(-expected, kind="stable")[:2])


def test_score_with_a_cross_encoder_matches_cross_encoder_predict(cross_encoder):
    model, process = cross_encoder
    pairs = sample_pairs(8, 4)
    predict = CrossEncoder(str(model.folder), device="cpu").predict
    queries, documents = [q for q, _ in pairs], [d for _, d in pairs]
    for path in ("/score", "/v1/score"):
        answer = post(process, path, {"model": CROSS_ENCODER, "text_1": queries, "text_2": documents}).json()
        assert answer["object"] == "list" and answer["id"].startswith("score-")
        assert [d["index"] for d in answer["data"]] == [0, 1, 2, 3]
        assert {d["object"] for d in answer["data"]} == {"score"}
        expected = predict(pairs)
        assert [d["score"] for d in answer["data"]] == pytest.approx(expected.tolist(), abs=SCORE_TOLERANCE)
    one_to_many = post(process, "/score", {"queries": queries[0], "documents": documents}).json()
    expected = predict([(queries[0], d) for d in documents])
    assert [d["score"] for d in one_to_many["data"]] == pytest.approx(expected.tolist(), abs=SCORE_TOLERANCE)
    single = post(process, "/score", {"text_1": [queries[1]], "text_2": documents[1]}).json()
    assert single["data"][0]["score"] == pytest.approx(float(predict([pairs[1]])[0]), abs=SCORE_TOLERANCE)


def test_rerank_and_score_with_an_embedding_model_are_cosines(embedding_server, st_embedder):
    query, documents = TEXTS[0], TEXTS[1:]
    unit = reference(st_embedder, [query, *documents])
    expected = (unit[1:] @ unit[0]).tolist()
    answer = post(embedding_server, "/v1/rerank", {"query": query, "documents": documents, "top_n": 3}).json()
    assert len(answer["results"]) == 3
    assert [r["index"] for r in answer["results"]] == sorted(range(len(documents)), key=lambda i: -expected[i])[:3]
    for r in answer["results"]:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=SCORE_TOLERANCE)
    scored = post(embedding_server, "/score", {"text_1": query, "text_2": documents}).json()
    assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=SCORE_TOLERANCE)
    lengths = [len(st_embedder.tokenizer(t)["input_ids"]) for t in TEXTS]
    assert scored["usage"]["prompt_tokens"] == sum(lengths)  # the query is embedded once
    pairwise = post(embedding_server, "/v1/score", {"data_1": documents[:2], "data_2": documents[2:4]}).json()
    expected = [float(unit[1] @ unit[3]), float(unit[2] @ unit[4])]
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(expected, abs=SCORE_TOLERANCE)


def test_bad_rerank_and_score_requests_answer_400(embedding_server, cross_encoder):
    for process in (embedding_server, cross_encoder[1]):
        error(post(process, "/rerank", {"query": "a", "documents": []}), 400, "documents")
        error(post(process, "/rerank", {"query": "a"}), 400, "documents")
        error(
            post(process, "/rerank", {"query": "a", "documents": ["b"], "use_activation": False}), 400, "use_activation"
        )
        error(post(process, "/rerank", {"query": "a", "documents": ["b"], "rank_fields": ["x"]}), 400, "rank_fields")
        error(post(process, "/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}), 400, "text_1")
        error(post(process, "/score", {"text_1": "a"}), 400, "text_1")
        error(post(process, "/score", {"text_1": "a", "documents": ["b"]}), 400, "text_1")
        error(post(process, "/score", {"text_1": [], "text_2": "b"}), 400, "text_1")
        long = " ".join(TEXTS * 3)
        assert "documents[1]" in error(post(process, "/v1/rerank", {"query": "a", "documents": ["b", long]}), 400)
        accepted = post(process, "/score", {"text_1": "a", "text_2": "b", "activation": True, "padding": "do_not_pad"})
        assert accepted.status_code == 200, accepted.text
    truncated = post(cross_encoder[1], "/rerank", {"query": "a", "documents": [long], "truncate_prompt_tokens": 32})
    assert truncated.status_code == 200 and truncated.json()["usage"]["prompt_tokens"] == 32


# -- metrics ------------------------------------------------------------------------------------------------------


def test_pooling_requests_and_tokens_are_counted(embedding_server, cross_encoder):
    def counts(process: ServerProcess, task: str, name: str) -> tuple[float, float, float]:
        return (
            process.metric("heteroserve:pooling_requests_total", task=task, model_name=name),
            process.metric("heteroserve:pooling_prompt_tokens_total", task=task, model_name=name),
            process.metric("heteroserve:prompt_tokens_total", model_name=name),
        )

    before = counts(embedding_server, "embed", EMBEDDER)
    answer = post(embedding_server, "/v1/embeddings", {"input": TEXTS[:3]}).json()
    tokens = answer["usage"]["prompt_tokens"]
    assert counts(embedding_server, "embed", EMBEDDER) == (before[0] + 3, before[1] + tokens, before[2] + tokens)
    process = cross_encoder[1]
    before = counts(process, "score", CROSS_ENCODER)
    answer = post(process, "/rerank", {"query": "a", "documents": TEXTS[:2]}).json()
    tokens = answer["usage"]["prompt_tokens"]
    assert counts(process, "score", CROSS_ENCODER) == (before[0] + 2, before[1] + tokens, before[2] + tokens)


def test_a_chat_template_embedder_embeds_what_sentence_transformers_6_embeds(tmp_path_factory):
    """A decoder embedder saved by sentence-transformers 6 with a chat template ("message" modality): the server
    renders each input through the template as `encode` does."""
    model = build_chat_embedder(tmp_path_factory.mktemp("served") / "chat_embedder")
    texts = sample_texts(4, 11)
    reference = SentenceTransformer(str(model.folder), device="cpu").encode(texts, convert_to_tensor=True)
    process = ServerProcess(
        "--model", str(model.folder), "--served-model-name", "chat-embedder", env={"HETEROSERVE_NUM_THREADS": "1"}
    )
    try:
        client = openai.OpenAI(base_url=f"{process.base_url}/v1", api_key="unused", max_retries=0)
        data = client.embeddings.create(model="chat-embedder", input=texts).data
    finally:
        process.stop()
    ours = torch.tensor([d.embedding for d in data])
    assert cosines(ours, reference).min() >= COSINE

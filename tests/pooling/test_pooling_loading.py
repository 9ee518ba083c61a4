"""How a pooling checkpoint is read: its task and pooling, sentence-transformers' modules and settings, overrides,
and the checkpoints and settings that are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

from heteroserve.config import ModelConfig
from heteroserve.distributed.parallel_state import ParallelGroups
from heteroserve.model.encoder import EncoderModel
from heteroserve.model.layers.pooler import ChatTemplateInput, PoolerSpec
from heteroserve.model.loader import LoadedModel, load_model
from heteroserve.model.loader.pooling_checkpoint import read_sentence_transformers
from heteroserve.platforms import resolve_platform
from heteroserve.pooling_params import PoolingParams
from tests.model.tiny_models import COMMON, save_tiny
from tests.pooling.direct import hidden_states, pooled, tokenize
from tests.pooling.tiny_pooling_models import QWEN3_PROMPTS, TinyPoolingModel, randomize_encoder, sample_texts

TEXTS = sample_texts(3, 6)


def load(folder: Path, kernels: str = "auto", **config) -> LoadedModel:
    return load_model(ModelConfig(str(folder), **config), resolve_platform("cpu"), kernels)


def copy_of(tiny: TinyPoolingModel, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny.folder, tmp_path / tiny.name))


def edit_json(path: Path, **values) -> None:
    content = json.loads(path.read_text())
    content.update(values)
    path.write_text(json.dumps(content))


def test_specs_of_the_tiny_checkpoints(bert_embedder, xlmr_cross_encoder, bert_cross_encoder, qwen3_embedder):
    expected = {
        "bert_embedder": PoolerSpec("embed", "MEAN", True, 64, (16, 32, 64), prompts={"query": "", "document": ""}),
        "xlmr_cross_encoder": PoolerSpec("score", "CLS", False, 64, num_labels=1, activation="sigmoid"),
        "bert_cross_encoder": PoolerSpec("score", "CLS", False, 64, num_labels=1, activation="sigmoid"),
        "qwen3_embedder": PoolerSpec("embed", "LAST", True, 64, prompts=QWEN3_PROMPTS),
    }
    for tiny in (bert_embedder, xlmr_cross_encoder, bert_cross_encoder, qwen3_embedder):
        loaded = load(tiny.folder)
        assert loaded.task == tiny.task
        assert loaded.pooler.spec == expected[tiny.name], tiny.name
        assert loaded.max_model_len == tiny.max_model_len  # XLM-R: 130 positions less its offset of 2
        assert loaded.sampling_defaults == {}
    qwen3 = load(qwen3_embedder.folder)
    assert qwen3.model.lm_head is None and not qwen3.model.has_lm_head
    with pytest.raises(RuntimeError, match="without an LM head"):
        qwen3.model.compute_logits(torch.zeros(1, 64))


def test_pooler_config_overrides_the_checkpoint(bert_embedder):
    loaded = load(bert_embedder.folder, pooler_config={"pooling_type": "CLS", "normalize": False})
    assert (loaded.pooler.spec.pooling_type, loaded.pooler.spec.normalize) == ("CLS", False)
    encoded = tokenize(loaded, TEXTS)
    hidden = hidden_states(loaded, encoded)
    firsts = torch.tensor([0] + [len(e["input_ids"]) for e in encoded[:-1]]).cumsum(0)
    torch.testing.assert_close(pooled(loaded, TEXTS, PoolingParams()), hidden[firsts])


def test_plain_encoder_pools_cls_normalised(bert_embedder, tmp_path):
    """A BertModel without sentence-transformers files: an embedding model with vLLM's defaults."""
    folder = copy_of(bert_embedder, tmp_path)
    for name in ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json"):
        (folder / name).unlink()
    shutil.rmtree(folder / "1_Pooling")
    loaded = load(folder)
    assert (loaded.task, loaded.pooler.spec.pooling_type, loaded.pooler.spec.normalize) == ("embed", "CLS", True)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        cls = torch.stack([model(**loaded.tokenizer(t, return_tensors="pt")).last_hidden_state[0, 0] for t in TEXTS])
    torch.testing.assert_close(pooled(loaded, TEXTS, PoolingParams()), F.normalize(cls, dim=1), rtol=0, atol=2e-5)


def test_dense_layers_follow_pooling(bert_embedder, tmp_path):
    """sentence-transformers' Dense modules (weights and activation from their folders) run after pooling."""
    from sentence_transformers.base.modules import Dense

    st = SentenceTransformer(str(bert_embedder.folder), device="cpu")
    dense = Dense(64, 32, activation_function=torch.nn.Tanh())
    randomize_encoder(dense, seed=5)
    modules = [st[0], st[1], dense, st[2]]
    folder = tmp_path / "with_dense"
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    edit_json(folder / "config.json", matryoshka_dimensions=None)  # declared for 64 values, and now there are 32
    loaded = load(folder)
    assert loaded.pooler.spec.embedding_size == 32
    reference = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(pooled(loaded, TEXTS, PoolingParams()), reference, rtol=0, atol=2e-5)


def test_causal_lm_as_pooling_model(tmp_path):
    """--runner pooling on a causal LM: the last token's final hidden state, normalised; the LM head is dropped."""
    tiny = save_tiny("qwen3", tmp_path)
    assert load(tiny.folder).task == "generate"
    loaded = load(tiny.folder, runner="pooling")
    assert loaded.task == "embed" and loaded.pooler.spec == PoolerSpec("embed", "LAST", True, COMMON["hidden_size"])
    prompts = [[5, 17, 42, 8, 99], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
    encoded = [{"input_ids": p, "token_type_ids": [0] * len(p)} for p in prompts]
    hidden = hidden_states(loaded, encoded)
    ours = torch.stack(loaded.pooler.pool(hidden, [len(p) for p in prompts], [PoolingParams()] * 2))
    model = tiny.reference.model
    with torch.no_grad():
        last = [model.model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts]
    torch.testing.assert_close(ours, F.normalize(torch.stack(last), dim=1), rtol=0, atol=2e-5)


def test_decoder_sequence_classifier_scores_the_last_token(tmp_path):
    config = AutoConfig.for_model("qwen3", **{**COMMON, "head_dim": 32, "num_labels": 1, "pad_token_id": 0})
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    randomize_encoder(model, seed=3)
    model.save_pretrained(tmp_path / "classifier")
    loaded = load(tmp_path / "classifier")
    assert (loaded.task, loaded.pooler.spec.pooling_type, loaded.pooler.spec.activation) == ("score", "LAST", "sigmoid")
    prompts = [[5, 17, 42, 8, 99], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
    encoded = [{"input_ids": p, "token_type_ids": [0] * len(p)} for p in prompts]
    hidden = hidden_states(loaded, encoded)
    ours = torch.stack(loaded.pooler.pool(hidden, [len(p) for p in prompts], [PoolingParams(task="score")] * 2))
    with torch.no_grad():
        logits = torch.cat([model(torch.tensor([p])).logits for p in prompts])
    torch.testing.assert_close(ours, logits.sigmoid(), rtol=0, atol=2e-5)


@pytest.mark.parametrize(
    ("pooling", "named"),
    [
        ({"pooling_mode": "max"}, "'max'"),
        ({"pooling_mode": ["mean", "cls"]}, r"\['mean', 'cls'\]"),
        ({"pooling_mode_weightedmean_tokens": True, "embedding_dimension": 64}, "'weightedmean'"),
        ({"pooling_mode": "mean", "include_prompt": False}, "include_prompt"),
    ],
)
def test_unsupported_pooling_is_refused(bert_embedder, tmp_path, pooling, named):
    folder = copy_of(bert_embedder, tmp_path)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    with pytest.raises(ValueError, match=named):
        load(folder)


def test_legacy_pooling_keys_are_read(bert_embedder, tmp_path):
    folder = copy_of(bert_embedder, tmp_path)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
    )
    assert load(folder).pooler.spec.pooling_type == "CLS"


def test_unknown_sentence_transformers_module_is_refused(bert_embedder, tmp_path):
    folder = copy_of(bert_embedder, tmp_path)
    modules = json.loads((folder / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="sentence_transformers.models.LayerNorm"):
        load(folder)


def test_refused_settings(bert_embedder, xlmr_cross_encoder, bert_cross_encoder):
    with pytest.raises(ValueError, match="cannot generate text, it is a bert encoder"):
        load(bert_embedder.folder, runner="generate")
    with pytest.raises(ValueError, match="cannot generate text, it is a sequence classifier"):
        load(bert_cross_encoder.folder, runner="generate")
    with pytest.raises(ValueError, match="exceeds this encoder's 128 positions"):
        load(xlmr_cross_encoder.folder, max_model_len=130)
    parallel = ParallelGroups(tp_size=2)
    with pytest.raises(ValueError, match="pooling models run on one rank"):
        load_model(ModelConfig(str(bert_embedder.folder)), resolve_platform("cpu"), parallel=parallel)


def test_gguf_models_only_generate(default_model_path):
    with pytest.raises(ValueError, match="GGUF models only generate"):
        load(default_model_path, runner="pooling")


def test_matryoshka_declarations(bert_embedder, tmp_path):
    folder = copy_of(bert_embedder, tmp_path)
    edit_json(folder / "config.json", matryoshka_dimensions=None, is_matryoshka=True)
    assert load(folder).pooler.spec.matryoshka_dimensions == ()
    edit_json(folder / "config.json", is_matryoshka=False)
    assert load(folder).pooler.spec.matryoshka_dimensions is None
    edit_json(folder / "config.json", matryoshka_dimensions=[16, 128])
    with pytest.raises(ValueError, match="matryoshka_dimensions"):
        load(folder)


def test_encoder_refuses_other_activations(bert_embedder, tmp_path):
    folder = copy_of(bert_embedder, tmp_path)
    edit_json(folder / "config.json", hidden_act="gelu_new")
    with pytest.raises(ValueError, match="'gelu_new'"):
        load(folder)


def test_encoder_weight_bytes_and_type(bert_embedder):
    loaded = load(bert_embedder.folder, "reference")
    assert isinstance(loaded.model, EncoderModel)
    parameters = sum(p.numel() for p in loaded.model.parameters())
    assert loaded.model.weight_bytes() == 4 * parameters


def test_bidirectional_decoder_is_refused(qwen3_embedder, tmp_path):
    """gte-Qwen2-style configs that ask for bidirectional attention in a decoder: refused, not run causally."""
    folder = copy_of(qwen3_embedder, tmp_path)
    edit_json(folder / "config.json", is_causal=False)
    with pytest.raises(ValueError, match="is_causal false"):
        load(folder)


def test_quantised_encoder_checkpoint_is_refused(bert_embedder, tmp_path):
    folder = copy_of(bert_embedder, tmp_path)
    edit_json(folder / "config.json", quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 32})
    with pytest.raises(ValueError, match="quantised encoder checkpoints are not supported"):
        load(folder)


MESSAGE = {"method": "forward", "method_output_name": "last_hidden_state", "format": "flat"}


@pytest.mark.parametrize(
    ("file", "values", "named"),
    [
        ("sentence_bert_config.json", {"pooling_window": 3}, r"unknown key\(s\) pooling_window"),
        ("sentence_bert_config.json", {"transformer_task": "fill-mask"}, "transformer_task 'fill-mask'"),
        ("sentence_bert_config.json", {"module_output_name": "sentence_embedding"}, "module_output_name"),
        (
            "sentence_bert_config.json",
            {"modality_config": {"message": {**MESSAGE, "format": "auto"}}},
            "modality_config.message.format 'auto'",
        ),
        (
            "sentence_bert_config.json",
            {"modality_config": {"text": {**MESSAGE, "method": "get_text_features"}}},
            "modality_config.text reads 'get_text_features'",
        ),
        ("sentence_bert_config.json", {"processing_kwargs": {"text": {"max_length": 5}}}, "processing_kwargs text"),
        (
            "sentence_bert_config.json",
            {"processing_kwargs": {"chat_template": {"truncation": True}}},
            "processing_kwargs.chat_template truncation",
        ),
        ("sentence_bert_config.json", {"do_lower_case": True}, "do_lower_case with a message modality"),
        ("sentence_bert_config.json", {"query_length": 32}, "query_length"),
        ("sentence_bert_config.json", {"processor_kwargs": {"add_eos_token": True}}, "processor_kwargs add_eos_token"),
        ("config_sentence_transformers.json", {"truncate_dim": 32}, "truncate_dim"),
        ("config_sentence_transformers.json", {"default_prompt_name": "passage"}, "default_prompt_name 'passage'"),
    ],
)
def test_sentence_transformers_settings_not_computed_are_refused(chat_embedder, tmp_path, file, values, named):
    """What would make our tokens or embeddings differ from sentence-transformers' is refused by name."""
    folder = copy_of(chat_embedder, tmp_path)
    edit_json(folder / file, **values)
    with pytest.raises(ValueError, match=named):
        read_sentence_transformers(folder)


def test_sentence_transformers_settings_read_or_reported(chat_embedder, tmp_path):
    """Settings without effect on what the engine computes load; those it leaves aside are logged."""
    folder = copy_of(chat_embedder, tmp_path)
    edit_json(
        folder / "sentence_bert_config.json",
        unpad_inputs=False,
        tokenizer_args={"padding_side": "left", "trust_remote_code": True},
        processing_kwargs={"chat_template": {"add_generation_prompt": True, "restore_suffix": False}},
    )
    edit_json(folder / "config_sentence_transformers.json", similarity_fn_name="dot", card_notes="x")
    st = read_sentence_transformers(folder)
    expected = ChatTemplateInput(False, template_kwargs={"add_generation_prompt": True}, restore_suffix=False)
    assert st.transformer.chat_template == expected
    similarity, unknown = st.notes
    assert "similarity_fn_name 'dot' is not used" in similarity and "unknown key(s) card_notes" in unknown

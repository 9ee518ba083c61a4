"""What a pooling checkpoint says about itself: its task, its pooling, its Dense layers, its prompts.

A sentence-transformers folder describes its pipeline in modules.json (Transformer -> Pooling -> Dense ... ->
Normalize) with each module's config in its own folder (the Transformer's: transformer_module.py); a cross-encoder
names its activation. Anything this engine does not compute the way sentence-transformers does is refused by name
rather than approximated; what it leaves aside without changing its results (similarity_fn_name, keys it does not
know in config_sentence_transformers.json) is logged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import PretrainedConfig

from heteroserve.config import ModelConfig
from heteroserve.model.encoder import ENCODER_TYPES
from heteroserve.model.layers.pooler import ACTIVATIONS, ClassifierHead, DenseLayer, Pooler, PoolerSpec
from heteroserve.model.loader.transformer_module import TransformerModule, read_transformer_module

logger = logging.getLogger(__name__)

# sentence-transformers' pooling modes (1_Pooling/config.json) -> ours; the legacy boolean keys name them too.
POOLING_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_MODULE_KINDS = ("Transformer", "Pooling", "Dense", "Normalize")
# The config_sentence_transformers.json keys the engine knows (read, without effect on it, or refused when set).
_MODEL_CONFIG_KEYS = {
    "__version__",
    "model_type",
    "prompts",
    "default_prompt_name",
    "activation_fn",
    "similarity_fn_name",
    "keep_in_fp32_modules",  # precision of some of a CrossEncoder's modules
    "requirements",  # the package versions sentence-transformers checks before loading
    "truncate_dim",  # refused when set
}


@dataclass
class SentenceTransformersConfig:
    """A sentence-transformers folder's pipeline, as far as the engine computes it."""

    pooling_type: str | None = None  # None: no Pooling module (a cross-encoder)
    dense: list[DenseLayer] = field(default_factory=list)
    normalize: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt: str | None = None  # the prompt of default_prompt_name, applied to every text
    activation: str | None = None  # a CrossEncoder's activation_fn
    transformer: TransformerModule = field(default_factory=TransformerModule)  # how texts become tokens
    cross_encoder: bool = False
    notes: tuple[str, ...] = ()  # settings the engine leaves aside, logged when the pooler is built


def read_sentence_transformers(folder: Path) -> SentenceTransformersConfig | None:
    """None when the folder is not a sentence-transformers model (no modules.json)."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    st = SentenceTransformersConfig()
    for module in _read_json(modules_file):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = folder / module.get("path", "")
        if kind not in _MODULE_KINDS:
            raise ValueError(
                f"{modules_file}: sentence-transformers module {module.get('type')!r} is not supported "
                f"(supported: {', '.join(_MODULE_KINDS)})"
            )
        if kind == "Transformer" and module.get("path", "") != "":
            raise ValueError(f"{modules_file}: the Transformer module must be the folder itself, not {path.name}/")
        if kind == "Pooling":
            st.pooling_type = _pooling_type(_read_json(path / "config.json"), path)
        elif kind == "Dense":
            st.dense.append(_dense_layer(path))
        elif kind == "Normalize":
            st.normalize = True
    model_config_file = folder / "config_sentence_transformers.json"
    model_config = _read_optional_json(model_config_file)
    st.prompts = dict(model_config.get("prompts") or {})
    st.default_prompt = _default_prompt(model_config, st.prompts, model_config_file)
    st.cross_encoder = model_config.get("model_type") == "CrossEncoder"
    if model_config.get("activation_fn"):
        st.activation = activation_name(model_config["activation_fn"])
    st.notes = _model_config_notes(model_config, model_config_file)
    st.transformer = read_transformer_module(folder, st.cross_encoder)
    return st


def _default_prompt(model_config: dict, prompts: dict[str, str], path: Path) -> str | None:
    """The prompt sentence-transformers' encode and predict apply when none is named; None for none."""
    name = model_config.get("default_prompt_name")
    if name is None:
        return None
    if name not in prompts:
        raise ValueError(f"{path}: default_prompt_name {name!r} is not one of its prompts ({', '.join(prompts)})")
    return prompts[name] or None


def _model_config_notes(model_config: dict, path: Path) -> tuple[str, ...]:
    """What config_sentence_transformers.json asks that the engine leaves aside, as log lines; truncate_dim, which
    changes every embedding, is refused."""
    if model_config.get("truncate_dim") is not None:
        raise ValueError(
            f"{path}: truncate_dim is not supported (ask for `dimensions` per request: the engine cuts, then "
            "normalises)"
        )
    notes = []
    similarity = model_config.get("similarity_fn_name")
    if similarity not in (None, "cosine"):
        notes.append(
            f"{path}: similarity_fn_name {similarity!r} is not used: scoring with this embedding model answers "
            "cosine similarity, as vLLM's does"
        )
    unknown = sorted(set(model_config) - _MODEL_CONFIG_KEYS)
    if unknown:
        notes.append(f"{path}: unknown key(s) {', '.join(unknown)} are not read")
    return tuple(notes)


def _pooling_type(config: dict, path: Path) -> str:
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in _LEGACY_POOLING_KEYS.items() if config.get(key)]
        mode = modes[0] if len(modes) == 1 else modes or "mean"
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if not isinstance(mode, str) or mode not in POOLING_MODES:
        raise ValueError(
            f"{path}/config.json: pooling mode {mode!r} is not supported (supported: {', '.join(POOLING_MODES)})"
        )
    if config.get("include_prompt") is False:
        raise ValueError(f"{path}/config.json: include_prompt false (pooling without the prompt) is not supported")
    return POOLING_MODES[mode]


def _dense_layer(path: Path) -> DenseLayer:
    config = _read_json(path / "config.json")
    if config.get("use_residual"):
        raise ValueError(f"{path}/config.json: a Dense module with use_residual is not supported")
    activation = activation_name(config.get("activation_function", "torch.nn.modules.activation.Tanh"))
    if (path / "model.safetensors").is_file():
        tensors = load_file(str(path / "model.safetensors"))
    elif (path / "pytorch_model.bin").is_file():
        tensors = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{path}: a Dense module without weights (model.safetensors or pytorch_model.bin)")
    weight = tensors["linear.weight"].float()
    expected = (config.get("out_features"), config.get("in_features"))
    if tuple(weight.shape) != expected:
        raise ValueError(f"{path}: Dense weight has shape {tuple(weight.shape)}, its config says {expected}")
    bias = tensors.get("linear.bias")
    return DenseLayer(weight, None if bias is None else bias.float(), activation)


def activation_name(path: str) -> str:
    """A torch.nn activation class path (sentence-transformers' config) -> our name; others are refused."""
    name = path.rsplit(".", 1)[-1].lower()
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {path!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return name


def model_task(hf_config: PretrainedConfig, st: SentenceTransformersConfig | None, runner: str) -> str:
    """'generate', 'embed' or 'score' (a *ForSequenceClassification model: a cross-encoder or classifier)."""
    architecture = (getattr(hf_config, "architectures", None) or [""])[0]
    classifier = architecture.endswith("ForSequenceClassification") or (st is not None and st.cross_encoder)
    encoder = hf_config.model_type in ENCODER_TYPES
    if runner == "generate":
        if encoder or classifier:
            kind = f"a sequence classifier ({architecture})" if classifier else f"a {hf_config.model_type} encoder"
            raise ValueError(f"--runner generate: this model cannot generate text, it is {kind}; use --runner pooling")
        return "generate"
    if runner == "auto" and st is None and not encoder and not classifier:
        return "generate"
    return "score" if classifier else "embed"


def pooler_spec(
    task: str,
    hf_config: PretrainedConfig,
    st: SentenceTransformersConfig | None,
    config: ModelConfig,
    hidden_size: int,
    num_labels: int = 0,
) -> PoolerSpec:
    """The pooling of a model: sentence-transformers' settings where the folder has them, else vLLM's defaults
    (CLS and normalised for encoders, last token and normalised for decoders), then config.pooler_config's."""
    encoder = hf_config.model_type in ENCODER_TYPES
    pooling_type = "CLS" if encoder else "LAST"
    normalize = task == "embed"
    if st is not None and st.pooling_type is not None:
        pooling_type, normalize = st.pooling_type, st.normalize
    overrides = config.pooler_config or {}
    pooling_type = overrides.get("pooling_type", pooling_type)
    normalize = overrides.get("normalize", normalize)
    dense = st.dense if st is not None else []
    size = dense[-1].weight.shape[0] if dense else hidden_size
    if task == "score":
        return PoolerSpec(
            task="score",
            pooling_type=pooling_type,
            normalize=False,
            embedding_size=hidden_size,
            num_labels=num_labels,
            activation=_score_activation(hf_config, st, num_labels),
            **_input_settings(st),
        )
    return PoolerSpec(
        task="embed",
        pooling_type=pooling_type,
        normalize=normalize,
        embedding_size=size,
        matryoshka_dimensions=_matryoshka(hf_config, size),
        **_input_settings(st),
    )


def _input_settings(st: SentenceTransformersConfig | None) -> dict:
    """PoolerSpec's fields on how texts are tokenized, as sentence-transformers does."""
    if st is None:
        return {}
    return {
        "prompts": st.prompts,
        "default_prompt": st.default_prompt,
        "lowercase": st.transformer.lowercase,
        "chat_template": st.transformer.chat_template,
    }


def build_pooler(
    task: str,
    hf_config: PretrainedConfig,
    st: SentenceTransformersConfig | None,
    config: ModelConfig,
    hidden_size: int,
    head: ClassifierHead | None,
    device: torch.device,
) -> Pooler:
    """The pooler with its Dense layers and classifier head on the model's device (float32: pooled rows are few)."""

    def on_device(layer: DenseLayer) -> DenseLayer:
        bias = None if layer.bias is None else layer.bias.to(device)
        return DenseLayer(layer.weight.to(device), bias, layer.activation)

    num_labels = head.out.weight.shape[0] if head is not None else 0
    spec = pooler_spec(task, hf_config, st, config, hidden_size, num_labels)
    for note in st.notes if st is not None else ():
        logger.warning(note)
    dense = [on_device(layer) for layer in st.dense] if st is not None and task == "embed" else []
    if head is not None:
        head = ClassifierHead(on_device(head.out), None if head.dense is None else on_device(head.dense))
    return Pooler(spec, dense, head)


def decoder_pooling_tensors(tensors: Iterable[tuple[str, object]], score_head: dict) -> Iterator[tuple[str, object]]:
    """A decoder embedder's or classifier's tensors under the names load_weights reads: a base model's (as
    sentence-transformers saves Qwen3-Embedding) gain the "model." prefix; a classifier's `score` projection goes
    to score_head instead."""
    for name, tensor in tensors:
        if name.startswith("score."):
            score_head[name] = tensor
        elif name.startswith(("model.", "lm_head.")):
            yield name, tensor
        else:
            yield "model." + name, tensor


def decoder_score_head(score_head: dict) -> ClassifierHead:
    """A decoder classifier's head (*ForSequenceClassification): one projection of the last token, no dense layer."""
    weight = score_head.get("score.weight")
    if not isinstance(weight, torch.Tensor):
        raise ValueError("checkpoint is missing the classifier head tensor 'score.weight'")
    bias = score_head.get("score.bias")
    return ClassifierHead(DenseLayer(weight.float(), None if bias is None else bias.float()))


def default_max_model_len(st: SentenceTransformersConfig | None, positions: int) -> int:
    """The model's positions, or sentence-transformers' max_seq_length where it is shorter (what it truncates to)."""
    if st is not None and st.transformer.max_seq_length:
        return min(positions, st.transformer.max_seq_length)
    return positions


def _score_activation(hf_config: PretrainedConfig, st: SentenceTransformersConfig | None, num_labels: int) -> str:
    """As sentence-transformers' CrossEncoder decides: its saved activation_fn (config_sentence_transformers.json,
    or config.json's "sentence_transformers" entry in older saves), else sigmoid for one label, identity for more."""
    if st is not None and st.activation is not None:
        return st.activation
    saved = (getattr(hf_config, "sentence_transformers", None) or {}).get("activation_fn")
    saved = saved or getattr(hf_config, "sbert_ce_default_activation_function", None)
    if saved:
        return activation_name(saved)
    return "sigmoid" if num_labels == 1 else "identity"


def _matryoshka(hf_config: PretrainedConfig, size: int) -> tuple[int, ...] | None:
    """config.json's `matryoshka_dimensions` (the sizes the model was trained at) or `is_matryoshka: true` (any)."""
    dimensions = getattr(hf_config, "matryoshka_dimensions", None)
    if dimensions:
        dims = tuple(int(d) for d in dimensions)
        if any(not 1 <= d <= size for d in dims):
            raise ValueError(f"config.json matryoshka_dimensions {list(dims)} must lie within 1..{size}")
        return dims
    return () if getattr(hf_config, "is_matryoshka", False) else None


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc


def _read_optional_json(path: Path) -> dict:
    return _read_json(path) if path.is_file() else {}

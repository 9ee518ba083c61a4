"""Loads a model, its tokenizer and its generation defaults from any supported source."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from heteroserve.config import ModelConfig
from heteroserve.distributed.parallel_state import ParallelGroups
from heteroserve.model.arch import ModelArch
from heteroserve.model.decoder import DecoderModel
from heteroserve.model.encoder import ENCODER_TYPES, EncoderArch, EncoderModel
from heteroserve.model.families import VISION_LANGUAGE
from heteroserve.model.layers.pooler import Pooler
from heteroserve.model.loader.canonical_tensors import canonical_tensors
from heteroserve.model.loader.encoder_weights import ENCODER_PROJECTIONS, load_encoder_weights
from heteroserve.model.loader.gguf_loader import gguf_config, iterate_gguf, open_gguf
from heteroserve.model.loader.model_config import read_model_config
from heteroserve.model.loader.pooling_checkpoint import (
    SentenceTransformersConfig,
    build_pooler,
    decoder_pooling_tensors,
    decoder_score_head,
    default_max_model_len,
    model_task,
    read_sentence_transformers,
)
from heteroserve.model.loader.remote_code_layouts import remote_code_layout
from heteroserve.model.loader.remote_code_tokenizers import chat_stop_token_ids, remote_code_tokenizer
from heteroserve.model.loader.safetensors_loader import iterate_safetensors
from heteroserve.model.loader.source import ModelSource, resolve_model
from heteroserve.model.loader.weights import load_weights, quantize_projections
from heteroserve.model.placement import place_on
from heteroserve.model.sharding import ModelShard
from heteroserve.model.vision.encoder import VisionEncoder
from heteroserve.model.vision.loading import build_vision_encoder, split_vision_tensors
from heteroserve.platforms import OperatorTable, Platform, resolve_platform
from heteroserve.quantization.checkpoint import MXFP4, checkpoint_quantization, unpack_checkpoint

logger = logging.getLogger(__name__)

# generation_config.json fields that become default sampling parameters, as vLLM applies them.
_GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass
class LoadedModel:
    source: ModelSource
    model: DecoderModel | EncoderModel
    hf_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None
    dtype: torch.dtype
    max_model_len: int
    eos_token_id: int | None
    extra_eos_token_ids: list[int] = field(default_factory=list)
    sampling_defaults: dict[str, object] = field(default_factory=dict)
    vision: VisionEncoder | None = None  # the image encoder of a vision-language model
    task: str = "generate"  # "generate", or a pooling model's "embed" / "score"
    pooler: Pooler | None = None  # a pooling model's head (pooler.spec: what it returns and accepts)


def load_model(
    config: ModelConfig, platform: Platform, kernels: str = "auto", parallel: ParallelGroups | None = None
) -> LoadedModel:
    """The model, or with `parallel` this rank's share of it (sliced as the checkpoint streams in)."""
    source = resolve_model(config.model)
    quantization = config.quantization
    st = None
    if source.gguf_file is not None:
        if config.runner == "pooling":
            raise ValueError(f"--runner pooling: {source.gguf_file.name} is a GGUF file, and GGUF models only generate")
        if quantization in ("int4", "int8"):
            raise ValueError(
                f"--quantization {quantization} is for float checkpoints; this GGUF file is already quantised"
            )
        if quantization not in (None, "none", "gguf"):
            raise ValueError(f"--quantization {quantization} does not match {source.gguf_file}: it is a GGUF file")
        reader = open_gguf(source.gguf_file)
        hf_config = gguf_config(reader)
        tensors = iterate_gguf(reader, hf_config, keep_quantized=quantization != "none")
    else:
        hf_config = read_model_config(source.folder)
        st = read_sentence_transformers(source.folder)
    checkpoint_dtype = stored_dtype(source, hf_config)
    task = "generate" if source.gguf_file is not None else model_task(hf_config, st, config.runner)
    if task != "generate" and parallel is not None and parallel.world_size > 1:
        raise ValueError(
            f"tensor / pipeline parallelism ({parallel.tp_size} x {parallel.pp_size} ranks): pooling models run on "
            "one rank; drop --tensor-parallel-size / --pipeline-parallel-size"
        )
    if task != "generate" and hf_config.model_type in VISION_LANGUAGE:
        raise ValueError(f"pooling with a vision-language model ({hf_config.model_type}) is not supported")
    if getattr(hf_config, "is_causal", True) is False and hf_config.model_type not in ENCODER_TYPES:
        raise ValueError(
            f"{source.folder}: config.json sets is_causal false (a {hf_config.model_type} decoder with bidirectional "
            "attention, as some embedders are); the decoder here attends causally only"
        )
    if hf_config.model_type in ENCODER_TYPES:
        return _load_encoder(source, config, hf_config, st, task, checkpoint_dtype, platform, kernels)
    layout = remote_code_layout(source.folder) if source.gguf_file is None else None
    if source.gguf_file is None:
        tensors = _checkpoint_tensors(source.folder, hf_config, quantization, quantize=False)
        if layout is not None:
            tensors = layout.tensors(tensors, hf_config)
    arch = ModelArch.from_hf_config(hf_config)
    vision_tensors: dict[str, torch.Tensor] = {}
    if hf_config.model_type in VISION_LANGUAGE:
        tensors = split_vision_tensors(tensors, vision_tensors)
    tensors = canonical_tensors(tensors, arch)
    if quantization in ("int4", "int8"):  # under our names, so every family's projections are found
        tensors = quantize_projections(tensors, quantization)
    dtype = platform.resolve_dtype(config.dtype, checkpoint_dtype)
    max_model_len = config.max_model_len or default_max_model_len(st, arch.max_position_embeddings)
    context_limit = arch.context_limit or (layout.context_limit if layout is not None else None)
    if max_model_len > arch.max_position_embeddings and context_limit:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's {arch.max_position_embeddings} positions: "
            f"{context_limit}; lower --max-model-len"
        )
    if max_model_len > arch.max_position_embeddings:
        logger.warning("max_model_len %d exceeds the model's %d positions", max_model_len, arch.max_position_embeddings)
    ops = platform.operator_table(dtype, kernels)
    expert_ops, expert_dtype = _host_experts(config, hf_config.model_type, arch, platform, dtype, kernels)
    shard = ModelShard.of(arch, parallel) if parallel is not None else None
    if shard is not None:
        tensors = shard.take(tensors)
    model = DecoderModel(
        arch,
        hf_config,
        max(max_model_len, arch.max_position_embeddings),
        ops,
        shard,
        lm_head=task == "generate",
        attn_backend=platform.get_attn_backend(ops),
        expert_ops=expert_ops,
    )
    score_head: dict[str, torch.Tensor] = {}
    if task != "generate":  # sentence-transformers saves the base model: no "model." prefix, no LM head
        tensors = decoder_pooling_tensors(tensors, score_head)
    load_weights(model, tensors, dtype)
    if expert_ops is not None:
        _to_expert_dtype(model, expert_dtype)
    place_on(model, platform.device)
    model.eval()
    model.prepare_weights()
    vision = None
    if hf_config.model_type in VISION_LANGUAGE:
        vision = build_vision_encoder(hf_config, vision_tensors, dtype, platform.device)
    logger.info("weights: %.1f MiB as stored", model.weight_bytes() / 2**20)
    logger.info("kernels on %s: %s", platform.name, ", ".join(f"{k}={v}" for k, v in ops.describe().items()))
    logger.info("attention backend: %s", model.attn_backend.name)

    pooler = None
    if task != "generate":
        head = decoder_score_head(score_head) if task == "score" else None
        pooler = build_pooler(task, hf_config, st, config, arch.hidden_size, head, platform.device)
    tokenizer = load_tokenizer(source)
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    if eos is None:
        eos = _first(getattr(hf_config.get_text_config(), "eos_token_id", None))
    generation = _generation_config(source.folder) if config.generation_config == "auto" else {}
    extra_eos = [t for t in _as_list(generation.get("eos_token_id")) if t != eos]
    if tokenizer is not None and source.gguf_file is None:  # the repositories' chat functions stop there too
        extra_eos += [t for t in chat_stop_token_ids(tokenizer, source.folder) if t != eos and t not in extra_eos]
    defaults = {ours: generation[theirs] for theirs, ours in _GENERATION_DEFAULTS.items() if theirs in generation}
    if task != "generate":
        defaults = {}
    return LoadedModel(
        source, model, hf_config, tokenizer, dtype, max_model_len, eos, extra_eos, defaults, vision, task, pooler
    )


def _host_experts(
    config: ModelConfig, model_type: str, arch: ModelArch, platform: Platform, dtype: torch.dtype, kernels: str
) -> tuple[OperatorTable | None, torch.dtype]:
    """The CPU platform's operators and activations dtype for routed experts kept in host memory
    (--moe-experts-device cpu), or (None, dtype) where they run with the rest of the model."""
    if config.moe_experts_device is None:
        return None, dtype
    moe_layers = sum(spec.moe is not None for spec in arch.layers)
    if not moe_layers:
        raise ValueError(f"--moe-experts-device cpu: {model_type} has no mixture-of-experts layers")
    if platform.device_type == "cpu":
        logger.info("--moe-experts-device cpu: the platform is the CPU, where the experts run with the rest")
        return None, dtype
    cpu = resolve_platform("cpu")
    cpu.configure_process()
    expert_dtype = dtype if dtype in cpu.supported_dtypes() else torch.float32
    cpu.assign_threads(expert_dtype, kernels)
    expert_ops = cpu.operator_table(expert_dtype, kernels)
    logger.info(
        "routers and routed experts of %d layers in host memory on the CPU platform (%s activations, linear=%s); "
        "the rest of the model on %s",
        moe_layers,
        str(expert_dtype).removeprefix("torch."),
        expert_ops.linear.name,
        platform.device,
    )
    return expert_ops, expert_dtype


def _to_expert_dtype(model: DecoderModel, dtype: torch.dtype) -> None:
    """Dense routed experts in the dtype their host activations take (compressed ones stay as they are)."""
    for layer in model.layers:
        moe = layer.moe
        if moe is None:
            continue
        moe.host_dtype = dtype
        for name in ("experts_gate_up", "experts_down", "experts_gate_up_bias", "experts_down_bias"):
            weights = getattr(moe, name)
            setattr(
                moe,
                name,
                [w.to(dtype) if isinstance(w, torch.Tensor) and w.is_floating_point() else w for w in weights],
            )


def _load_encoder(
    source: ModelSource,
    config: ModelConfig,
    hf_config: PretrainedConfig,
    st: SentenceTransformersConfig | None,
    task: str,
    checkpoint_dtype: torch.dtype,
    platform: Platform,
    kernels: str,
) -> LoadedModel:
    """A BERT / RoBERTa / XLM-RoBERTa embedding model or cross-encoder, with its pooler."""
    arch = EncoderArch.from_hf_config(hf_config)
    max_model_len = config.max_model_len or default_max_model_len(st, arch.max_model_len)
    if max_model_len > arch.max_model_len:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds this encoder's {arch.max_model_len} positions "
            f"(max_position_embeddings {arch.max_position_embeddings} - offset {arch.position_offset})"
        )
    detected = checkpoint_quantization(source.folder, hf_config)
    if detected:
        raise ValueError(
            f"{source.folder} is a {detected[0].upper()} checkpoint: quantised encoder checkpoints are not supported; "
            "use the float checkpoint (with --quantization int8 or int4 to quantise it at load)"
        )
    dtype = platform.resolve_dtype(config.dtype, checkpoint_dtype)
    ops = platform.operator_table(dtype, kernels)
    tensors = _checkpoint_tensors(source.folder, hf_config, config.quantization, ENCODER_PROJECTIONS)
    model = EncoderModel(arch, ops)
    head = load_encoder_weights(model, tensors, dtype, classifier=task == "score")
    place_on(model, platform.device)
    model.eval()
    model.prepare_weights()
    logger.info("weights: %.1f MiB as stored", model.weight_bytes() / 2**20)
    logger.info("kernels on %s: %s", platform.name, ", ".join(f"{k}={v}" for k, v in ops.describe().items()))
    pooler = build_pooler(task, hf_config, st, config, arch.hidden_size, head, platform.device)
    tokenizer = load_tokenizer(source)
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    return LoadedModel(source, model, hf_config, tokenizer, dtype, max_model_len, eos, task=task, pooler=pooler)


def _checkpoint_tensors(
    folder: Path,
    hf_config: PretrainedConfig,
    quantization: str | None,
    projections: tuple[str, ...] | None = None,
    quantize: bool = True,
):
    """The folder's tensors, unpacked from a detected GPTQ/AWQ format, and with `quantize` quantised at load as
    asked (the weights whose names end in `projections`; None: a decoder's)."""
    detected = checkpoint_quantization(folder, hf_config)
    method = detected[0] if detected else "none (float weights)"
    if quantization in ("gguf", "gptq", "awq") and quantization != method:
        wanted = "GGUF file" if quantization == "gguf" else f"{quantization.upper()} checkpoint"
        raise ValueError(
            f"--quantization {quantization} does not match {folder}: it is not a {wanted} (found: {method})"
        )
    if quantization in ("int4", "int8") and detected and method != MXFP4:  # MXFP4 loads as float: see mxfp4.py
        raise ValueError(
            f"--quantization {quantization} is for float checkpoints; {folder} is already quantised ({method})"
        )
    tensors = iterate_safetensors(folder)
    if detected:
        tensors = unpack_checkpoint(tensors, *detected, dequantize=quantization == "none")
        if method != MXFP4:
            return tensors
    if quantize and quantization in ("int4", "int8"):
        return quantize_projections(tensors, quantization, projections)
    return tensors


def stored_dtype(source: ModelSource, hf_config: PretrainedConfig) -> torch.dtype:
    """The dtype of the checkpoint's float tensors, which dtype="auto" keeps where the platform computes it (a GGUF
    file's tensors are dequantised to float32)."""
    return torch.float32 if source.gguf_file is not None else _config_dtype(hf_config)


def _config_dtype(config: PretrainedConfig) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _generation_config(folder: Path) -> dict:
    path = folder / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase | None:
    """The folder's tokenizer, one rebuilt for a tokenizer that is repository code (remote_code_tokenizers.py), or
    one built from GGUF metadata (both cached, since building takes seconds)."""
    if source.gguf_file is None:
        remote = remote_code_tokenizer(source.folder)
        if remote is not None:
            return remote
        if not any(
            (source.folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        ):
            logger.warning("%s has no tokenizer; prompts must be token ids", source.folder)
            return None
        return AutoTokenizer.from_pretrained(source.folder)
    stat = source.gguf_file.stat()
    key = hashlib.sha1(f"{source.gguf_file}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cache = Path.home() / ".cache" / "heteroserve" / "tokenizers" / key
    if (cache / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(cache)
    reader = open_gguf(source.gguf_file)
    if "tokenizer.ggml.tokens" not in reader.fields:
        logger.warning("%s has no tokenizer metadata; prompts must be token ids", source.gguf_file)
        return None
    tokenizer = AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file.name)
    try:
        tokenizer.save_pretrained(cache)
    except OSError:
        logger.warning("could not cache the tokenizer in %s", cache)
    return tokenizer


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _first(value) -> int | None:
    values = _as_list(value)
    return values[0] if values else None

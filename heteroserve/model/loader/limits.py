"""What the engine's settings depend on before any weight loads: the context length and whether the model pools."""

from __future__ import annotations

from dataclasses import dataclass

from heteroserve.config import ModelConfig
from heteroserve.model.arch import ModelArch
from heteroserve.model.encoder import ENCODER_TYPES, EncoderArch
from heteroserve.model.loader.gguf_loader import gguf_config, open_gguf
from heteroserve.model.loader.model_config import read_model_config
from heteroserve.model.loader.pooling_checkpoint import default_max_model_len, model_task, read_sentence_transformers
from heteroserve.model.loader.source import resolve_model


@dataclass(frozen=True)
class CheckpointLimits:
    max_model_len: int  # the asked-for context length, else the checkpoint's
    pooling: bool  # the model embeds or scores instead of generating


def checkpoint_limits(config: ModelConfig) -> CheckpointLimits:
    """Reads only the checkpoint's config (config.json, sentence-transformers files or GGUF metadata), with the
    loader's rules for the default length and the task, so the scheduler is configured before the model loads; the
    loader still checks the length against the weights it builds."""
    source = resolve_model(config.model)
    if source.gguf_file is not None:
        arch = ModelArch.from_hf_config(gguf_config(open_gguf(source.gguf_file)))
        return CheckpointLimits(config.max_model_len or arch.max_position_embeddings, pooling=False)
    hf_config = read_model_config(source.folder)
    st = read_sentence_transformers(source.folder)
    pooling = model_task(hf_config, st, config.runner) != "generate"
    if hf_config.model_type in ENCODER_TYPES:
        positions = EncoderArch.from_hf_config(hf_config).max_model_len
    else:
        positions = ModelArch.from_hf_config(hf_config).max_position_embeddings
    return CheckpointLimits(config.max_model_len or default_max_model_len(st, positions), pooling)

"""Checks that the model splits over the requested ranks before any worker starts: reading config.json or a
GGUF header takes milliseconds, starting workers takes seconds (and each would fail the same way)."""

from __future__ import annotations

from heteroserve.config import EngineConfig
from heteroserve.distributed.parallel_state import layer_range
from heteroserve.model.arch import ModelArch
from heteroserve.model.families import VISION_LANGUAGE
from heteroserve.model.loader.gguf_loader import gguf_config, open_gguf
from heteroserve.model.loader.model_config import read_model_config
from heteroserve.model.loader.pooling_checkpoint import model_task, read_sentence_transformers
from heteroserve.model.loader.source import resolve_model
from heteroserve.model.sharding import check_tensor_parallel


def check_model_split(config: EngineConfig) -> None:
    """A ValueError naming the problem when the heads, MLP rows or layers cannot be split as asked."""
    parallel = config.parallel
    source = resolve_model(config.model.model)
    if source.gguf_file is not None:
        hf_config = gguf_config(open_gguf(source.gguf_file))
    else:
        try:
            hf_config = read_model_config(source.folder)
        except ValueError:
            return  # the workers' loader reports an unreadable checkpoint in its own words
    if source.gguf_file is None:
        task = model_task(hf_config, read_sentence_transformers(source.folder), config.model.runner)
        if task != "generate":
            raise ValueError(
                f"tensor / pipeline parallelism ({parallel.tensor_parallel_size} x {parallel.pipeline_parallel_size}"
                f" ranks): pooling models (this one's task: {task}) run on one rank; drop --tensor-parallel-size "
                "/ --pipeline-parallel-size"
            )
    if hf_config.model_type in VISION_LANGUAGE:
        raise ValueError(
            f"{hf_config.model_type} runs on one rank: tensor and pipeline parallelism cover the text "
            "architectures only (the vision tower and image inputs are not split or sent to workers)"
        )
    arch = ModelArch.from_hf_config(hf_config)
    check_tensor_parallel(arch, parallel.tensor_parallel_size, parallel.enable_expert_parallel)
    layer_range(arch.num_layers, 0, parallel.pipeline_parallel_size)

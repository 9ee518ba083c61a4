"""EngineArgs lists every engine setting once: the CLI flags and LLM's keywords come from it and build one config."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from heteroserve.config import SchedulerConfig
from heteroserve.engine.engine_args import EngineArgs, cli_flag
from heteroserve.entrypoints.llm import LLM
from heteroserve.entrypoints.openai.server_args import SERVER_PREFILL_TOKENS_PER_STEP, make_parser
from tests.pooling.tiny_pooling_models import build_bert_embedder

SETTINGS = [f for f in dataclasses.fields(EngineArgs) if f.name != "model"]


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return parser


def test_every_setting_is_a_flag_and_an_llm_keyword():
    parser = engine_parser()
    flags = {option for action in parser._actions for option in action.option_strings}
    defaults = vars(parser.parse_args([]))
    for setting in SETTINGS:
        assert cli_flag(setting.name) in flags, setting.name
        assert defaults[setting.name] == setting.default, setting.name
    assert EngineArgs.from_kwargs(**{s.name: s.default for s in SETTINGS}) == EngineArgs()


def test_the_server_takes_every_engine_flag():
    """The server's one default of its own: a burst's prompts are prefilled in capped steps (0 turns it off)."""
    args = make_parser().parse_args(["--num-kv-blocks", "12", "-tp", "1", "-q", "none"])
    server_default = {"max_prefill_tokens_per_step": SERVER_PREFILL_TOKENS_PER_STEP}
    assert EngineArgs.from_cli_args(args, None) == EngineArgs(num_kv_blocks=12, quantization="none", **server_default)
    off = make_parser().parse_args(["--max-prefill-tokens-per-step", "0"])
    assert EngineArgs.from_cli_args(off, None).create_engine_config().scheduler.max_prefill_tokens_per_step is None


def test_cli_and_llm_keywords_build_equal_configs():
    args = engine_parser().parse_args(
        [
            "--max-model-len",
            "512",
            "--num-kv-blocks",
            "40",
            "--no-enable-prefix-caching",
            "--limit-mm-per-prompt",
            "image=2",
            "--mm-processor-kwargs",
            '{"max_pixels": 50176}',
            "--max-image-pixels",
            "1000000",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3}',
            "--scheduling-policy",
            "priority",
        ]
    )
    from_cli = EngineArgs.from_cli_args(args, None).create_engine_config()
    from_llm = EngineArgs.from_kwargs(
        max_model_len=512,
        num_kv_blocks=40,
        enable_prefix_caching=False,
        limit_mm_per_prompt={"image": 2},
        mm_processor_kwargs={"max_pixels": 50176},
        max_image_pixels=1_000_000,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        scheduling_policy="priority",
    ).create_engine_config()
    assert from_cli == from_llm
    assert from_cli.cache.num_kv_blocks == 40
    assert from_cli.multimodal.limit_images_per_prompt == 2
    assert from_cli.multimodal.max_image_pixels == 1_000_000
    assert from_cli.speculative.num_speculative_tokens == 3
    assert from_cli.scheduler.policy == "priority"


def test_unknown_llm_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="'max_model_length'; did you mean max_model_len"):
        LLM(max_model_length=512)  # refused before any model loads
    with pytest.raises(TypeError, match="'frobnicate'"):
        EngineArgs.from_kwargs(frobnicate=True)


def test_max_model_len_is_resolved_before_the_scheduler_config_is_built():
    assert not hasattr(SchedulerConfig, "finalize")
    config = EngineArgs().create_engine_config()  # the embedded model: a GGUF file's 8192 positions
    assert config.model.max_model_len == config.scheduler.max_model_len == 8192
    assert config.scheduler.max_num_batched_tokens == 2048
    config = EngineArgs(max_model_len=300, enable_chunked_prefill=False).create_engine_config()
    assert config.scheduler.max_model_len == config.scheduler.max_num_batched_tokens == 300


def test_a_pooling_checkpoint_is_known_before_it_loads(tmp_path):
    embedder = build_bert_embedder(tmp_path / "bert_embedder")
    config = EngineArgs(model=str(embedder.folder)).create_engine_config()
    assert config.scheduler.pooling
    assert config.scheduler.max_num_batched_tokens == max(8192, config.scheduler.max_model_len)
    shorter = EngineArgs(model=str(embedder.folder), max_model_len=64).create_engine_config().scheduler
    assert (shorter.max_model_len, shorter.max_num_batched_tokens) == (64, 8192)


def test_kv_cache_memory_bytes_takes_units_on_the_cli_and_in_llm():
    args = make_parser().parse_args(["--kv-cache-memory-bytes", "1.5GiB"])
    assert args.kv_cache_memory_bytes == 3 * 2**29
    config = EngineArgs.from_kwargs(kv_cache_memory_bytes="256MiB").create_engine_config()
    assert config.cache.kv_cache_memory_bytes == 256 * 2**20

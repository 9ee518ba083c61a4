"""What every bench command shares: the engine under test, the prompts, the peers' names, the report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from heteroserve.bench.machine import describe_machine
from heteroserve.bench.peers import PEERS
from heteroserve.bench.workload import jsonl_requests, random_requests, scenario_requests
from heteroserve.engine.engine_args import EngineArgs
from heteroserve.engine.llm_engine import LLMEngine

T = TypeVar("T")


def build_engine(args: argparse.Namespace) -> LLMEngine:
    for peer in args.peer:
        if peer not in PEERS:
            raise SystemExit(f"unknown peer {peer!r}; known: {', '.join(PEERS)}")
    if args.max_model_len is None:
        args.max_model_len = 2048
    if getattr(args, "lora_adapters", None):
        args.enable_lora = True
        args.max_loras = max(args.max_loras, args.lora_adapters)
        args.max_lora_rank = max(args.max_lora_rank, args.lora_rank)
    return LLMEngine(EngineArgs.from_cli_args(args, args.model).create_engine_config())


def engine_requests(engine: LLMEngine, args, scenario: str, num: int):
    if args.input_len >= engine.model.max_model_len:
        raise SystemExit(f"--input-len {args.input_len} does not fit max_model_len={engine.model.max_model_len}")
    return dataset(engine.model.tokenizer, engine.model.vocab_size, args, scenario, num)


def dataset(tokenizer, vocab_size: int, args, scenario: str, num: int):
    if args.dataset == "random":
        return random_requests(vocab_size, num, args.input_len, args.output_len, args.seed)
    if tokenizer is None:
        raise SystemExit("this model has no tokenizer: use --dataset random")
    if args.dataset == "workload":
        return scenario_requests(tokenizer.encode, scenario, num, args.input_len, args.output_len)
    if not Path(args.dataset).is_file():
        raise SystemExit(f"--dataset {args.dataset!r} is neither workload, random nor a JSONL file")
    return jsonl_requests(args.dataset, tokenizer.encode, args.output_len)[:num]


def runnable_peers(engine: LLMEngine, args, result: dict):
    """(name, peer) for each --peer that can run here; one that cannot is recorded as skipped, with why."""
    from heteroserve.model.loader.source import resolve_model

    source = resolve_model(engine.config.model.model)
    for name in args.peer:
        if name == "hf":
            from heteroserve.bench.peers.hf_peer import HFPeer

            yield name, HFPeer(source, engine.model.dtype)
            continue
        if name == "vllm":
            from heteroserve.bench.peers.hf_folder import hf_checkpoint_folder
            from heteroserve.bench.peers.vllm_peer import VLLMPeer, vllm_missing

            missing = vllm_missing()
            if missing is not None:
                print(f"skipping the vllm peer: {missing}")
                result["peers"][name] = {"skipped": missing}
                continue
            yield name, VLLMPeer(hf_checkpoint_folder(source), engine.model.dtype, engine.model.max_model_len)
            continue
        from heteroserve.bench.peers.llama_cpp_peer import LlamaCppPeer, llama_cpp_missing

        missing = llama_cpp_missing()
        if missing is not None:
            print(f"skipping the llama-cpp peer: {missing}")
            result["peers"][name] = {"skipped": missing}
            continue
        dequantised = engine.config.model.quantization == "none"  # our weights in engine.model.dtype: the peer's too
        yield name, LlamaCppPeer(source, engine.model.max_model_len, engine.model.dtype if dequantised else None)


def median_round(rounds: list[T], key: Callable[[T], float]) -> T:
    """The round whose `key` is the median (the lower middle of an even count)."""
    return sorted(rounds, key=key)[(len(rounds) - 1) // 2]


def speculative_fields(engine: LLMEngine) -> dict:
    """The speculative decoding configuration (None when off) and how many drafts the model confirmed (counted
    since the engine started: over every round of a bench command)."""
    config = engine.config.speculative
    stats = engine.stats()
    drafts, accepted = stats.spec_draft_tokens, stats.spec_accepted_tokens
    return {
        "speculative": dataclasses.asdict(config) if config is not None else None,
        "spec_draft_tokens": drafts,
        "spec_accepted_tokens": accepted,
        "spec_acceptance_rate": accepted / drafts if drafts else None,
        # Of the steps that checked drafts, the share that kept the draft at each position.
        "spec_acceptance_by_position": [n / stats.spec_num_drafts for n in stats.spec_accepted_per_position],
    }


def write_report(args, result: dict) -> None:
    result["machine"] = describe_machine(result.pop("_platform"))
    result["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if args.plot:
        from heteroserve.bench.plot import plot_result

        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot_result(result, args.plot)
        print(f"wrote {args.plot}")
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.output_json}")

"""Decode steps replayed from recorded graphs (worker/decode_graphs.py). On a device with graphs (CUDA) the real
ones; on the CPU a graph that replays by running the recorded forward again over the same buffers: what a CUDA graph
does, without its launch savings.

On the CPU that checks everything of the replay path but the device's recording itself: the step's inputs and
metadata copied into the recorded buffers, padding rows that write to a block outside the pool, table widths that
grow with the requests, the first rows of the output taken as the step's, and the eager path for what the graphs do
not cover. Tokens and logprobs are checked against transformers on tiny random checkpoints (one KV group; windows;
two KV groups with soft-capping), and against the same engine with --enforce-eager on the default model.
"""

from __future__ import annotations

import logging

import pytest
import torch

from heteroserve import LLM, SamplingParams
from heteroserve.platforms import resolve_platform
from heteroserve.platforms.cpu.platform import CpuPlatform
from heteroserve.platforms.graph_capture import GraphCapture
from heteroserve.worker.decode_graphs import capture_sizes, copy_into
from tests.model.tiny_models import check_output, greedy_params, prompts, run, save_tiny
from tests.reference import NEAR_TIE, GreedyComparison


class RerunGraph:
    def __init__(self, forward, output: torch.Tensor) -> None:
        self.forward, self.output = forward, output

    def replay(self) -> None:
        self.output.copy_(self.forward())


class RerunGraphCapture(GraphCapture):
    """Records nothing: `replay` runs the forward again over the recorded buffers and writes the recorded output."""

    def __init__(self) -> None:
        super().__init__("rerun graphs", RerunGraph, None, lambda: None)

    def record(self, forward, pool):
        output = forward()
        return RerunGraph(forward, output), output


class FailingGraphCapture(RerunGraphCapture):
    def record(self, forward, pool):
        raise RuntimeError("operation not permitted when stream is capturing")


@pytest.fixture
def graphs(monkeypatch) -> None:
    """The device's own graphs where it has them, else the CPU with re-running graphs."""
    if resolve_platform("auto").graph_capture() is None:
        monkeypatch.setattr(CpuPlatform, "graph_capture", lambda self: RerunGraphCapture())


def test_capture_sizes_cover_every_row_count():
    sizes = capture_sizes(256)
    assert sizes[:8] == [1, 2, 4, 8, 16, 24, 32, 40] and sizes[-1] == 256
    assert capture_sizes(3) == [1, 2, 3] and capture_sizes(1) == [1]
    for rows in range(1, 257):
        size = next(s for s in sizes if s >= rows)
        assert size - rows < 32 and (rows == 1 or size < 2 * rows), rows


def test_metadata_of_another_shape_is_refused():
    recorded = {None: [torch.zeros(4, 2), 3]}
    copy_into(recorded, {None: [torch.ones(4, 2), 3]})
    assert recorded[None][0].sum() == 8
    with pytest.raises(ValueError, match=r"\(5, 2\)"):
        copy_into(recorded, {None: [torch.ones(5, 2), 3]})
    with pytest.raises(ValueError, match="value is 4"):
        copy_into(recorded, {None: [torch.ones(4, 2), 4]})


@pytest.mark.parametrize("name", ["qwen2", "mistral", "gemma2"])
def test_replayed_decode_steps_match_transformers(name, graphs, tmp_path):
    """Five requests of different lengths and budgets: the batch shrinks as they finish (replays of 8, 4 and 2
    rows with padding), and the longest table grows from 7 blocks to 9 (widths 8 and 16). Reference kernels so that the
    paged backend's metadata is what gets copied; mistral has an 8-token window, gemma2 two KV groups."""
    tiny = save_tiny(name, tmp_path, seed=7)
    llm = tiny.llm(kernels="reference", block_size=4, num_kv_blocks=48)
    lengths = [3, 9, 17, 2, 26]
    budgets = [12, 4, 16, 7, 10]
    token_prompts = prompts(11, lengths, tiny.vocab_size)
    params = [greedy_params(tiny.vocab_size, max_tokens=n) for n in budgets]
    outputs = run(llm, token_prompts, params)
    comparison = GreedyComparison()
    for i, (output, prompt, n) in enumerate(zip(outputs, token_prompts, budgets, strict=True)):
        check_output(f"{name}[{i}]", output, prompt, tiny.reference, comparison, max_tokens=n)
    print(comparison.summary())
    runner = llm.engine.runner
    recorded = sorted(runner.graphs.recorded)
    assert runner.graphs.replayed > 10 and {size for size, _ in recorded} >= {8, 4, 2}, recorded
    assert {width for _, width in recorded} == {8, 16}, recorded
    assert comparison.sequences == 5 and not comparison.near_tie_divergences


@pytest.mark.parametrize("quantization", [None, "none"], ids=["shipped", "float32"])
def test_the_default_model_replays_the_eager_tokens(quantization, graphs):
    """The default model with the platform's own kernels (the CPU's fused decode layer reads the padded metadata):
    the same tokens and logprobs as the same engine with --enforce-eager, for requests that batch differently as
    they end; tokens may part only at a near-tie of the eager run (tests/reference.py)."""
    texts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "def fib(n):"]
    budgets = [20, 9, 14, 5]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in budgets]

    def answers(**kwargs) -> tuple[list, LLM]:
        llm = LLM(quantization=quantization, max_model_len=256, kv_cache_memory_bytes=32 * 2**20, **kwargs)
        return [o.outputs[0] for o in llm.generate(texts, params, use_tqdm=False)], llm

    replayed, llm = answers()
    assert llm.engine.runner.graphs.replayed > 10
    eager, llm = answers(enforce_eager=True)
    assert llm.engine.runner.graphs is None
    margins, divergences = [], 0
    for ours, theirs in zip(replayed, eager, strict=True):
        steps = zip(ours.token_ids, ours.logprobs, theirs.token_ids, theirs.logprobs, strict=True)
        for token, entry, eager_token, eager_entry in steps:
            top = sorted((e.logprob for e in eager_entry.values()), reverse=True)
            margins.append(top[0] - top[1])
            if token != eager_token:
                assert margins[-1] < NEAR_TIE, f"token {token}, eager {eager_token}, eager margin {margins[-1]:.2e}"
                divergences += 1
                break
            assert abs(entry[token].logprob - eager_entry[token].logprob) < 1e-4
    print(
        f"top-2 logprob margins of {len(margins)} tokens: smallest {min(margins):.3g}; "
        f"{divergences} near-tie divergences"
    )


def test_a_failed_recording_says_so_and_runs_eagerly(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(CpuPlatform, "graph_capture", lambda self: FailingGraphCapture())
    tiny = save_tiny("qwen2", tmp_path, seed=3)
    token_prompts = prompts(5, [6, 11], tiny.vocab_size)
    with caplog.at_level(logging.WARNING, logger="heteroserve.worker.decode_graphs"):
        outputs = run(
            tiny.llm(device="cpu", kernels="reference"), token_prompts, greedy_params(tiny.vocab_size, max_tokens=6)
        )
    assert "rerun graphs off" in caplog.text and "operation not permitted when stream is capturing" in caplog.text
    comparison = GreedyComparison()
    for i, (output, prompt) in enumerate(zip(outputs, token_prompts, strict=True)):
        check_output(f"eager[{i}]", output, prompt, tiny.reference, comparison, max_tokens=6)


def test_enforce_eager_records_nothing(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(CpuPlatform, "graph_capture", lambda self: RerunGraphCapture())
    tiny = save_tiny("qwen2", tmp_path, seed=3)
    with caplog.at_level(logging.INFO, logger="heteroserve.worker.model_runner"):
        llm = tiny.llm(device="cpu", kernels="reference", enforce_eager=True)
    run(llm, prompts(5, [6], tiny.vocab_size), greedy_params(tiny.vocab_size, max_tokens=4))
    assert llm.engine.runner.graphs is None and "rerun graphs off: --enforce-eager" in caplog.text

"""Two "nodes" on 127.0.0.1: the head and a `heteroserve serve --node-rank 1` process meet through
torch.distributed's TCP rendezvous; their greedy tokens must match transformers (near-tie rule).
The pipeline-parallel case is in the slow set (`python -m pytest tests/distributed -m slow`);
pipeline parallelism on one node is in the default one."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from heteroserve.entrypoints.llm import LLM
from tests.entrypoints.server_process import ServerProcess, free_port
from tests.model.tiny_models import TinyModel, greedy_params, prompts, save_tiny

NEW_TOKENS = 8
ENGINE_FLAGS = ["--max-model-len", "128", "--dtype", "float32", "--kv-cache-memory-bytes", str(4 * 1024**2)]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> TinyModel:
    return save_tiny("qwen2", tmp_path_factory.mktemp("nodes"))


def start_second_node(model: TinyModel, port: int, *parallel: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "heteroserve.entrypoints.openai.api_server", str(model.folder), *ENGINE_FLAGS]
    command += [
        *parallel,
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]
    return subprocess.Popen(command)


def test_tensor_parallel_across_two_nodes_serves_requests(qwen2, greedy_comparison):
    """The head is a real server (`serve --tensor-parallel-size 2 --nnodes 2`), asked with the openai client."""
    port = free_port()
    node = start_second_node(qwen2, port, "--tensor-parallel-size", "2")
    head = None
    try:
        flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(port)]
        head = ServerProcess(str(qwen2.folder), *ENGINE_FLAGS, *flags)
        client = openai.OpenAI(base_url=f"{head.base_url}/v1", api_key="unused")
        for i, prompt in enumerate(prompts(11, [6, 19], qwen2.vocab_size)):
            completion = client.completions.create(
                model=str(qwen2.folder),
                prompt=prompt,
                max_tokens=NEW_TOKENS,
                temperature=0,
                logprobs=1,
                extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
            )
            ours = [int(t.removeprefix("token_id:")) for t in completion.choices[0].logprobs.tokens]
            greedy_comparison.check(f"2 nodes tp=2 [{i}]", ours, qwen2.reference.greedy(prompt, NEW_TOKENS))
        head.terminate()
        assert head.process.wait(60) == 0
        assert node.wait(60) == 0, "the second node should stop when the head shuts its ranks down"
    finally:
        if head is not None:
            head.stop()
        node.kill()


@pytest.mark.slow
def test_pipeline_parallel_across_two_nodes(qwen2, greedy_comparison):
    port = free_port()
    node = start_second_node(qwen2, port, "--pipeline-parallel-size", "2")
    try:
        llm = LLM(
            str(qwen2.folder),
            max_model_len=128,
            dtype="float32",
            kv_cache_memory_bytes=4 * 1024**2,
            pipeline_parallel_size=2,
            nnodes=2,
            master_port=port,
        )
        token_prompts = prompts(12, [9, 21], qwen2.vocab_size)
        params = greedy_params(qwen2.vocab_size, prompt_logprobs=False, max_tokens=NEW_TOKENS)
        outputs = llm.generate([{"prompt_token_ids": p} for p in token_prompts], params, use_tqdm=False)
        for i, (output, prompt) in enumerate(zip(outputs, token_prompts, strict=True)):
            reference = qwen2.reference.greedy(prompt, NEW_TOKENS)
            greedy_comparison.check(f"2 nodes pp=2 [{i}]", list(output.outputs[0].token_ids), reference)
        llm.shutdown()
        assert node.wait(60) == 0
    finally:
        node.kill()

"""The default model (a Q4_1 GGUF) through `heteroserve export onnx` and onnxruntime, against the engine and
transformers.

The export stores the 4-bit weights dequantised to float32, so onnxruntime is compared with the engine on the
same model dequantised at load (quantization="none") with the reference operators, on the top-20
log-probabilities of every prompt row and every generated token, within 1e-4 of the largest |logit| (the rule of
tests/model/tiny_models.py); greedy tokens against transformers' GGUF reference too. Exporting 30 layers takes
about 6 minutes on 2 cores, so it is in the slow set (`./scripts/test.sh -m slow tests/export`, docs/EXPORT.md);
the suite runs the same path on a tiny Q4_1 GGUF (test_onnx_export.py::test_q4_1_gguf_through_the_command_line).
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from heteroserve.entrypoints.cli import main
from heteroserve.export.onnx_runner import OnnxDecoder
from heteroserve.sampling_params import SamplingParams
from tests.export.onnx_steps import generate

NEW_TOKENS = 17  # the prefill's token, then 16 decode steps
TOP = 20
LOGIT_RTOL = 1e-4  # max |logprob difference| relative to the largest |logit|
TEXTS = ["The capital of France is", "def fibonacci(n):\n    # return the n-th Fibonacci number\n"]


@pytest.fixture(scope="session")
def default_export(tmp_path_factory):
    """The default model exported once per session through the command line; (folder, what it printed)."""
    out = tmp_path_factory.mktemp("default_onnx") / "onnx"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["export", "onnx", "--out", str(out), "--max-model-len", "256"])
    return out, printed.getvalue()


@pytest.fixture(scope="module")
def reference_llm():
    """The engine on the default model dequantised to float32, with the plain torch operators."""
    from heteroserve import LLM

    return LLM(max_model_len=256, num_kv_blocks=64, quantization="none", kernels="reference")


@pytest.mark.slow
def test_default_model_export_matches_engine(
    default_export, reference_llm, default_tokenizer, hf_default, greedy_comparison
):
    out, printed = default_export
    config = json.loads((out / "config.json").read_text())
    assert "dequantised to float32" in printed, printed
    assert config["weights"]["dequantized_from"], config["weights"]
    assert (out / config["tokenizer"] / "tokenizer_config.json").is_file()
    token_prompts = [default_tokenizer(text)["input_ids"] for text in TEXTS]
    onnx_run = generate(OnnxDecoder(out), token_prompts, NEW_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP)
    outputs = reference_llm.generate([{"prompt_token_ids": p} for p in token_prompts], params, use_tqdm=False)
    error, scale = 0.0, 0.0
    for i, (prompt, output) in enumerate(zip(token_prompts, outputs, strict=True)):
        completion = output.outputs[0]
        assert onnx_run.tokens[i] == list(completion.token_ids), (
            f"sequence {i}: onnxruntime {onnx_run.tokens[i]} != engine {list(completion.token_ids)}"
        )
        logits = torch.cat((onnx_run.prompt_logits[i][:-1], torch.stack(onnx_run.step_logits[i])))
        scale = max(scale, float(logits.abs().max()))
        ours = torch.log_softmax(logits, -1)
        entries = list(output.prompt_logprobs[1:]) + list(completion.logprobs)
        for row, entry in enumerate(entries):
            ids = list(entry)
            engine = torch.tensor([entry[t].logprob for t in ids])
            error = max(error, float((ours[row, ids] - engine).abs().max()))
        greedy_comparison.check(f"onnx default sequence {i}", onnx_run.tokens[i], hf_default.greedy(prompt, NEW_TOKENS))
    margin = min(onnx_run.margins())
    print(
        f"default model: max |logprob diff| {error:.2e} (top-{TOP}; largest |logit| {scale:.1f}), "
        f"smallest top-2 logit margin {margin:.2e}"
    )
    assert error <= LOGIT_RTOL * scale, f"onnxruntime's logprobs differ from the engine's by {error:.3e}"

"""The default model run 4-bit (its Q4_1 GGUF as shipped) against the same model dequantised to float32."""

from __future__ import annotations

import math

import torch

from heteroserve import LLM, SamplingParams
from heteroserve.bench.workload import prompt_ids

NUM_PROMPTS, PROMPT_LEN, CONTINUATION = 6, 64, 32


def _argmax_and_nll(output) -> tuple[list[int], list[float]]:
    """Per position: the model's top token and the negative log-likelihood of the actual token."""
    tops, nll = [], []
    for token, entry in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:], strict=True):
        tops.append(next(t for t, lp in entry.items() if lp.rank == 1))
        nll.append(-entry[token].logprob)
    return tops, nll


def test_quantized_argmax_agrees_under_teacher_forcing(default_llm, default_tokenizer, capsys):
    texts = [prompt_ids(default_tokenizer.encode, i, PROMPT_LEN) for i in range(NUM_PROMPTS)]
    greedy = SamplingParams(temperature=0, max_tokens=CONTINUATION, ignore_eos=True)
    sequences = [
        p + o.outputs[0].token_ids
        for p, o in zip(
            texts, default_llm.generate([{"prompt_token_ids": p} for p in texts], greedy, use_tqdm=False), strict=True
        )
    ]
    quantized = LLM(max_model_len=512, kv_cache_memory_bytes=64 * 1024**2)
    score = SamplingParams(max_tokens=1, prompt_logprobs=1)
    runs = {
        "float32": default_llm.generate([{"prompt_token_ids": s} for s in sequences], score, use_tqdm=False),
        "q4_1": quantized.generate([{"prompt_token_ids": s} for s in sequences], score, use_tqdm=False),
    }
    agree = total = 0
    nll: dict[str, list[float]] = {"float32": [], "q4_1": []}
    for reference, ours in zip(runs["float32"], runs["q4_1"], strict=True):
        ref_top, ref_nll = _argmax_and_nll(reference)
        our_top, our_nll = _argmax_and_nll(ours)
        agree += sum(a == b for a, b in zip(ref_top, our_top, strict=True))
        total += len(ref_top)
        nll["float32"] += ref_nll[: PROMPT_LEN - 1]  # perplexity on the workload text itself
        nll["q4_1"] += our_nll[: PROMPT_LEN - 1]
    rate = agree / total
    memory = quantized.engine.model.weight_bytes / default_llm.engine.model.weight_bytes
    perplexity = {name: math.exp(sum(v) / len(v)) for name, v in nll.items()}
    with capsys.disabled():
        print(
            f"\n4-bit vs float32 under teacher forcing: argmax agrees on {rate:.1%} of {total} positions; "
            f"perplexity on the workload text: float32 {perplexity['float32']:.3f}, q4_1 {perplexity['q4_1']:.3f}; "
            f"weight memory {quantized.engine.model.weight_bytes / 2**20:.1f} MiB = {memory:.1%} of float32"
        )
    assert rate >= 0.95
    assert perplexity["q4_1"] < 1.2 * perplexity["float32"]
    assert memory <= 0.30  # issue 6: 4-bit layers, 8-bit embedding read in place by the tied LM head
    model = quantized.engine.runner.model
    assert model.lm_head.weight.q.data_ptr() == model.embed_tokens.q.data_ptr()  # no copy of the table
    counted_twice = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        v.nbytes for m in model.modules() for v in vars(m).values() if hasattr(v, "nbytes") and not torch.is_tensor(v)
    )
    assert quantized.engine.model.weight_bytes == counted_twice - model.embed_tokens.nbytes  # the shared table once


def test_shipped_model_answers_the_demo_question():
    """The main job's model as shipped (4-bit, no --quantization) keeps the float model's answer."""
    llm = LLM(max_model_len=256, kv_cache_memory_bytes=32 * 1024**2)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(question, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert out.text == "The capital of France is Paris." and out.finish_reason == "stop"

"""Multi-LoRA serving against `peft`: adapters made by peft on tiny random base models, each request's greedy tokens
and logprobs (prompt logprobs included) against the adapter merged into the base model in transformers (float32),
with several adapters and the base model in one batch, swapped through one slot, under preemption, with the prefix
cache, speculative decoding and a quantised base."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import PeftModel

from heteroserve.lora.request import LoRARequest
from heteroserve.model.loader.weights import INT4_GROUP
from heteroserve.quantization.int4 import quantize_int4
from tests.lora.adapters import ATTENTION, MLP, TinyAdapter
from tests.model.tiny_models import as_reference, check_output, greedy_params, prompts, run
from tests.reference import GreedyComparison


@pytest.fixture(scope="module")
def comparison(greedy_comparison) -> GreedyComparison:
    return greedy_comparison  # reported at the end of the session


def _gaps(reference, prompt: list[int]) -> torch.Tensor:
    """The reference's top-2 logit gap at every prompt position (how far from a near-tie its predictions are)."""
    top2 = reference.logits(prompt).topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def _check_mixed(llm, base, adapters, comparison, label: str, lengths: list[int], seed: int) -> None:
    """Each prompt under the base model and under every adapter, all in one generate call."""
    token_prompts = prompts(seed, lengths)
    choices: list[TinyAdapter | None] = [None, *adapters]
    batch, loras, references = [], [], []
    for i, prompt in enumerate(token_prompts):
        for choice in choices[i % len(choices) :] + choices[: i % len(choices)]:
            batch.append(prompt)
            loras.append(None if choice is None else choice.request)
            references.append(base.reference if choice is None else choice.reference)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in batch],
        greedy_params(base.vocab_size),
        use_tqdm=False,
        lora_request=loras,
    )
    worst = 0.0
    tokens_by_prompt: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
    for output, prompt, lora, reference in zip(outputs, batch, loras, references, strict=True):
        name = "base" if lora is None else lora.lora_name
        worst = max(worst, check_output(f"{label}/{name}", output, prompt, reference, comparison))
        tokens_by_prompt.setdefault(tuple(prompt), set()).add(tuple(output.outputs[0].token_ids))
    # The adapters change the outputs: a test where they did not could not tell an adapter from the base.
    assert all(len(outs) == len(choices) for outs in tokens_by_prompt.values()), tokens_by_prompt
    gaps = torch.cat([_gaps(r, p) for r, p in zip(references, batch, strict=True)])
    print(
        f"{label}: {len(batch)} requests, largest relative logit error {worst:.1e}; reference top-2 logit gaps "
        f"over {len(gaps)} prompt positions: median {gaps.median():.2f}, 10th percentile {gaps.quantile(0.1):.2f}"
    )


def test_adapters_and_base_in_one_batch(base, adapters, comparison):
    llm = base.llm(enable_lora=True, max_loras=4)
    _check_mixed(llm, base, adapters, comparison, "max_loras=4", [5, 19, 33, 8, 40], seed=11)
    stats = llm.engine.runner.lora
    assert stats.num_loads == len(adapters) and stats.num_swaps == len(adapters)


def test_one_slot_swaps_three_adapters_in_flight_and_preempts(base, adapters, comparison):
    """max_loras=1: requests of three adapters are queued together; each adapter's requests run while the others
    wait (none is dropped), and a KV cache of 16 blocks also preempts running requests."""
    llm = base.llm(enable_lora=True, max_loras=1, max_cpu_loras=2, num_kv_blocks=16, block_size=8)
    _check_mixed(llm, base, adapters[:3], comparison, "max_loras=1", [30, 21, 44, 9], seed=12)
    lora = llm.engine.runner.lora
    assert lora.num_swaps >= 3
    assert lora.num_loads > 2, "three adapters through a host cache of two are read again"
    assert llm.engine.stats().num_preemptions > 0


def test_prefix_cache_is_keyed_by_adapter(base, adapters, comparison):
    """The same 40-token prompt under two adapters and the base model, one after another: none reads another's
    KV (each equals its own reference), while the same adapter asked again hits the cache."""
    llm = base.llm(enable_lora=True, max_loras=2, block_size=8)
    prompt = prompts(13, [40])[0]
    params = greedy_params(base.vocab_size, prompt_logprobs=False)
    for i, choice in enumerate([adapters[0], adapters[1], None, adapters[0]]):
        hits_before = llm.engine.stats().prefix_hits
        output = (
            run(llm, [prompt], params)
            if choice is None
            else llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=choice.request)
        )
        reference = base.reference if choice is None else choice.reference
        check_output("prefix", output[0], prompt, reference, comparison, expect_prompt_logprobs=False)
        hits = llm.engine.stats().prefix_hits - hits_before
        if i == 3:
            assert hits == 32, "the same adapter's second request reuses its four full blocks but the last"
        else:
            assert hits == 0, f"{choice and choice.request.lora_name}: read {hits} cached tokens of another adapter"


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_fused_decode_layer_adds_the_adapters_as_the_operators_do(quantization, base, adapters):
    """Decode steps with adapter rows (mixed with base rows) go through the CPU's one-call decode layer, which
    chains the adapters' products in; the same requests operator by operator give the same tokens and logprobs."""
    llm = base.llm(enable_lora=True, max_loras=4, quantization=quantization, enable_prefix_caching=False)
    layers = llm.engine.executor.worker.runner.model.layers
    fused = [layer.fused_decode for layer in layers]
    if not all(f is not None and f.takes_lora for f in fused):
        pytest.skip("the C++ kernels cannot be built here: no fused decode layer")
    adapter_rows = []

    def recording(fused_layer):
        def call(x, *args):
            if len(args) == 5:
                segments = args[4][1]
                adapter_rows.append(int((segments[:, 1] - segments[:, 0]).sum()))
            return fused_layer(x, *args)

        call.takes_lora = True
        return call

    token_prompts = prompts(21, [7, 18, 11, 25, 4])
    requests = [None, *(a.request for a in adapters)]
    params = greedy_params(base.vocab_size, prompt_logprobs=False)

    def generate():
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in token_prompts], params, use_tqdm=False, lora_request=requests
        )
        return [
            (o.outputs[0].token_ids, [[s[t].logprob for t in sorted(s)] for s in o.outputs[0].logprobs])
            for o in outputs
        ]

    for layer, fused_layer in zip(layers, fused, strict=True):
        layer.fused_decode = recording(fused_layer)
    with_fused = generate()
    assert adapter_rows and max(adapter_rows) == len(adapters), "decode steps of all adapters ran fused"
    for layer in layers:
        layer.fused_decode = None
    without = generate()
    for (tokens, logprobs), (tokens_unfused, logprobs_unfused) in zip(with_fused, without, strict=True):
        assert tokens == tokens_unfused
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(logprobs_unfused), atol=1e-5, rtol=0)


@pytest.mark.parametrize("lora_dtype", ["bfloat16", "float16"])
def test_16bit_adapters_match_peft_with_the_same_rounding(lora_dtype, base, adapters, comparison):
    """--lora-dtype: the adapter held in 16 bits, against peft with its A and B rounded to that dtype (adapter 0's
    scaling is 2, so rounding B before or after the scaling is the same); closer to that than to the float32
    adapter, so the rounding is the one the reference makes."""
    adapter = adapters[0]
    dtype = getattr(torch, lora_dtype)
    model = PeftModel.from_pretrained(copy.deepcopy(base.reference.model), adapter.path)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(parameter.to(dtype).float())
    rounded = as_reference(model.merge_and_unload())
    llm = base.llm(enable_lora=True, lora_dtype=lora_dtype)
    token_prompts = prompts(23, [26, 13])
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in token_prompts],
        greedy_params(base.vocab_size),
        use_tqdm=False,
        lora_request=adapter.request,
    )
    assert llm.engine.executor.worker.runner.lora.slots.a_t["qkv"].dtype == dtype
    for output, prompt in zip(outputs, token_prompts, strict=True):
        error = check_output(f"{lora_dtype} adapter", output, prompt, rounded, comparison)
        tokens = prompt + list(output.outputs[0].token_ids[:-1])
        ours = torch.tensor([[e[t].logprob for t in sorted(e)] for e in output.outputs[0].logprobs])
        logits = adapter.reference.logits(tokens)
        exact = torch.log_softmax(logits[len(prompt) - 1 :], -1)
        scale = logits.abs().max()
        assert error < float((ours - exact).abs().max() / scale) / 4, "the adapter was not held in 16 bits"


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_under_an_adapter(method, base, adapters, comparison):
    """n-gram drafts, or the base model without the adapter as the draft model."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    if method == "draft_model":
        spec = {"model": str(base.folder), "num_speculative_tokens": 3}
    llm = base.llm(enable_lora=True, speculative_config=spec)
    repetitive = [prompts(14, [6])[0] * 4, prompts(15, [5])[0] * 5]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in repetitive],
        greedy_params(base.vocab_size, prompt_logprobs=False),
        use_tqdm=False,
        lora_request=adapters[0].request,
    )
    for output, prompt in zip(outputs, repetitive, strict=True):
        check_output("spec", output, prompt, adapters[0].reference, comparison, expect_prompt_logprobs=False)
    assert llm.engine.stats().spec_draft_tokens > 0


def test_quantised_base_with_float_adapter(base, adapters, comparison):
    """QLoRA's case, a 4-bit base model plus a float adapter, against transformers running the base model's
    projections as our 4-bit format round-trips them (quantize_int4, then dequantised) with peft's adapter merged
    in. The reference operators keep the arithmetic comparable (the CPU's 4-bit kernels round activations)."""
    adapter = adapters[0]
    quantised = copy.deepcopy(base.reference.model)
    with torch.no_grad():
        for name, module in quantised.named_modules():
            if name.rsplit(".", 1)[-1] in ATTENTION + MLP:
                module.weight.copy_(quantize_int4(module.weight, INT4_GROUP).dequantize())
    reference = as_reference(PeftModel.from_pretrained(quantised, adapter.path).merge_and_unload())
    llm = base.llm(enable_lora=True, quantization="int4", kernels="reference")
    token_prompts = prompts(16, [24, 9])
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in token_prompts],
        greedy_params(base.vocab_size),
        use_tqdm=False,
        lora_request=adapter.request,
    )
    for output, prompt in zip(outputs, token_prompts, strict=True):
        check_output("int4 base + adapter", output, prompt, reference, comparison)


def test_bad_adapters_are_refused_with_the_problem_named(base, adapters, tmp_path):
    llm = base.llm(enable_lora=True, max_lora_rank=8)
    params = greedy_params(base.vocab_size, prompt_logprobs=False, max_tokens=2)

    def refused(lora: LoRARequest, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False, lora_request=lora)

    refused(adapters[2].request, r"rank 16 is above max_lora_rank=8")
    bad_target = tmp_path / "bad_target"
    bad_target.mkdir()
    for file in adapters[0].path.iterdir():
        (bad_target / file.name).write_bytes(file.read_bytes())
    config = json.loads((bad_target / "adapter_config.json").read_text())
    (bad_target / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "qkv_conv"]}))
    refused(LoRARequest("bad", 7, str(bad_target)), r"unknown target module 'qkv_conv'")
    (bad_target / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["lm_head"]}))
    refused(LoRARequest("saves", 8, str(bad_target)), r"modules_to_save \(lm_head\) is not supported")
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "adapter_config.json").write_text(json.dumps(config))
    refused(LoRARequest("missing", 9, str(missing)), r"has no adapter_model.safetensors")
    refused(LoRARequest("nowhere", 10, str(tmp_path / "nowhere")), r"is not a folder")
    # Nothing was left behind: the engine still serves the base model and the adapters it accepts.
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False, lora_request=adapters[1].request)
    assert len(out[0].outputs[0].token_ids) == 2
    refused(LoRARequest("again", 2, str(adapters[0].path)), r"lora_int_id 2 is adapter 'qv'")


def test_lora_needs_enable_lora(base, adapters):
    llm = base.llm()
    with pytest.raises(ValueError, match="LoRA is off"):
        llm.generate([{"prompt_token_ids": [1, 2]}], lora_request=adapters[0].request, use_tqdm=False)


def test_lora_dtype_needs_enable_lora(base):
    with pytest.raises(ValueError, match="lora_dtype applies to LoRA adapters"):
        base.llm(lora_dtype="bfloat16")
    with pytest.raises(ValueError, match="lora_dtype must be one of"):
        base.llm(enable_lora=True, lora_dtype="int8")

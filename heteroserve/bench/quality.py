"""`heteroserve bench quality`: how far a narrower activation dtype (--dtype, bfloat16 unless given) moves a
model's predictions from float32's, teacher-forced over the workload prompts (scenario B's: 64 prompts of P=128).

Both dtypes read the same prompts through prompt logprobs (one pass each, no sampling): at every prompt position
after the first, the most likely next token and the logprob of the prompt's actual next token. The report gives the
share of positions where the two dtypes' most likely tokens agree, and each dtype's perplexity of the prompt text;
issue #23 asks bfloat16 for >= 98% agreement and a perplexity within 1% of float32's. The engines run one after the
other, each shut down before the next starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

from heteroserve.bench.workload import fingerprint, scenario_requests
from heteroserve.engine.engine_args import EngineArgs
from heteroserve.entrypoints.env_report import collect_env
from heteroserve.entrypoints.llm import LLM
from heteroserve.outputs import RequestOutput
from heteroserve.sampling_params import SamplingParams

BASELINE_DTYPE = "float32"


@dataclasses.dataclass
class TeacherForced:
    """One dtype's predictions over the prompts, position by position (every prompt token after the first)."""

    argmax: list[list[int]]  # per prompt, the most likely token at each position
    logprobs: list[list[float]]  # per prompt, the logprob of the prompt's actual token at each position
    operators: dict[str, str]  # the kernel each operator ran on
    operator_fallbacks: dict[str, int]

    def perplexity(self) -> float:
        values = [lp for prompt in self.logprobs for lp in prompt]
        return math.exp(-sum(values) / len(values))


def top_token(position: dict) -> int:
    """The most likely token of one prompt_logprobs=1 entry: the prompt's token comes first, then topk's one
    (which ranks 1; where the prompt's token ties with it, both do, and topk's is the later entry)."""
    return [token for token, logprob in position.items() if logprob.rank == 1][-1]


def start(args: argparse.Namespace, dtype: str) -> LLM:
    """An engine from the command's flags with activations (and weights expanded at load) in `dtype`."""
    flags = argparse.Namespace(**{**vars(args), "dtype": dtype})
    return LLM.from_config(EngineArgs.from_cli_args(flags, args.model).create_engine_config())


def teacher_forced(llm: LLM, prompts: list[list[int]]) -> TeacherForced:
    """The prompts through `llm` with prompt logprobs, which is then shut down."""
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        outputs: list[RequestOutput] = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, False)
        engine = llm.engine
        operators = engine.platform.operator_table(engine.model.dtype).describe()
        fallbacks = dict(engine.platform.operator_fallbacks)
    finally:
        llm.shutdown()
    argmax, logprobs = [], []
    for ids, output in zip(prompts, outputs, strict=True):
        positions = output.prompt_logprobs[1:]  # the first prompt token has no prediction
        argmax.append([top_token(p) for p in positions])
        logprobs.append([p[token].logprob for p, token in zip(positions, ids[1:], strict=True)])
    return TeacherForced(argmax, logprobs, operators, fallbacks)


def compare(baseline: TeacherForced, candidate: TeacherForced) -> dict[str, float]:
    """Argmax agreement (share of positions) and the perplexities, with the candidate's change in percent."""
    pairs = [(a, b) for x, y in zip(baseline.argmax, candidate.argmax, strict=True) for a, b in zip(x, y, strict=True)]
    base, cand = baseline.perplexity(), candidate.perplexity()
    return {
        "positions": len(pairs),
        "argmax_agreement": round(sum(a == b for a, b in pairs) / len(pairs), 5),
        "perplexity_float32": round(base, 5),
        "perplexity": round(cand, 5),
        "perplexity_change_percent": round(100 * (cand / base - 1), 3),
    }


def run_quality_bench(args: argparse.Namespace) -> dict:
    if args.max_model_len is None:
        args.max_model_len = 2048
    baseline_llm = start(args, BASELINE_DTYPE)
    encode = baseline_llm.get_tokenizer().encode
    prompts = [ids for ids, _ in scenario_requests(encode, "B", args.num_prompts, args.input_len, 1)]
    baseline = teacher_forced(baseline_llm, prompts)
    candidate = teacher_forced(start(args, args.dtype), prompts)
    result = {
        "model": args.model or "the embedded default model",
        "dtype": args.dtype,
        "baseline_dtype": BASELINE_DTYPE,
        "prompts": {"count": len(prompts), "tokens": args.input_len, "fingerprint": fingerprint(prompts)},
        **compare(baseline, candidate),
        "operators": {BASELINE_DTYPE: baseline.operators, args.dtype: candidate.operators},
        "operator_fallbacks": {BASELINE_DTYPE: baseline.operator_fallbacks, args.dtype: candidate.operator_fallbacks},
        "machine": collect_env(),
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "operators")}, indent=2))
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(result, indent=2) + "\n")
    return result

"""Greedy token ids of the default model (float32) for the first prompts of the greedy test, as JSON.

scripts/test-aarch64.sh runs it on the emulated arm64 root and on the x86-64 host and compares the outputs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from heteroserve import LLM, SamplingParams  # noqa: E402
from tests.engine.test_default_model_greedy import ENGINE_KWARGS, TEXT_PROMPTS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    llm = LLM(**ENGINE_KWARGS)
    prompts = TEXT_PROMPTS[: args.prompts]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
    print(json.dumps({p: o.outputs[0].token_ids for p, o in zip(prompts, outputs, strict=True)}, ensure_ascii=False))


if __name__ == "__main__":
    main()

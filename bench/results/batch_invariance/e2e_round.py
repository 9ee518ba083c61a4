"""One round of end-to-end timings of the default model as shipped, for the tree in $TREE (or the installed one).
decode1: median ms between tokens of one request (P=128, 64 tokens); decode16 / decode64: median ms a step with
16 / 64 requests decoding; prefill512: ms to the first token of one 512-token prompt; prefill16x128: ms to prefill
16 prompts of 128 tokens (one 2048-row step)."""

import json
import os
import statistics
import sys
import time

if os.environ.get("TREE"):
    sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, os.environ["TREE"])
import heteroserve
from heteroserve import LLM, SamplingParams
from heteroserve.bench.workload import prompt_ids

llm = LLM(max_model_len=1024, kv_cache_memory_bytes=256 * 1024**2, enable_prefix_caching=False)
tok = llm.get_tokenizer()
enc = lambda t: tok.encode(t, add_special_tokens=False)
long_text = " ".join(__import__("heteroserve.bench.workload", fromlist=["x"]).prompt_text(i) for i in range(3))
p512 = enc(long_text)[:512]
p128 = [prompt_ids(enc, i, 128) for i in range(64)]


def gen(prompts, n):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return time.perf_counter() - t, out


gen([p128[0]], 4)  # warm-up
res = {}
_, out = gen([p128[1]], 64)
res["decode1"] = statistics.median(out[0].metrics.inter_token_gaps[2:]) * 1e3
_, out = gen(p128[:16], 24)
res["decode16"] = statistics.median(out[0].metrics.inter_token_gaps[4:]) * 1e3
_, out = gen(p128, 12)
res["decode64"] = statistics.median(out[0].metrics.inter_token_gaps[4:]) * 1e3
res["prefill512"] = min(gen([p512], 1)[0] for _ in range(2)) * 1e3
res["prefill16x128"] = min(gen(p128[16:32], 1)[0] for _ in range(2)) * 1e3
tree = os.path.dirname(heteroserve.__file__)
print(json.dumps({"tree": tree, **{k: round(v, 2) for k, v in res.items()}}), flush=True)

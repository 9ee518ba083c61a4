"""What loading leaves behind: once the engine is built, the GGUF file it read is no longer mapped into the
process (its pages would count in the resident memory beside the converted weights), and the engine still answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json, sys
from pathlib import Path
from heteroserve import LLM
from heteroserve.model.loader.source import default_model_path
from heteroserve.sampling_params import SamplingParams

path = str(default_model_path().resolve())
llm = LLM(max_model_len=256, kv_cache_memory_bytes=32 * 1024**2)
mapped = [line for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(path)]
out = llm.generate([{"prompt_token_ids": list(range(1000, 1016))}], SamplingParams(temperature=0, max_tokens=8))
print(json.dumps({"mapped": mapped, "tokens": out[0].outputs[0].token_ids}))
"""


def test_the_gguf_file_is_unmapped_once_the_engine_is_built():
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    assert probe["mapped"] == [], f"the GGUF file is still mapped: {probe['mapped']}"
    assert len(probe["tokens"]) == 8

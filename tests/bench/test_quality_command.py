"""`heteroserve bench quality`: the comparison's arithmetic, and the command end to end on a few short prompts."""

from __future__ import annotations

import json
import math

import pytest

from heteroserve.bench.quality import TeacherForced, compare, top_token
from heteroserve.outputs import Logprob
from tests.bench.test_bench_commands import SMALL, bench


def test_top_token_is_topks_entry_even_on_a_tie():
    assert top_token({5: Logprob(-0.1, 1)}) == 5  # the prompt's token is the most likely
    assert top_token({5: Logprob(-2.0, 3), 9: Logprob(-0.1, 1)}) == 9
    assert top_token({5: Logprob(-0.5, 1), 9: Logprob(-0.5, 1)}) == 9  # tied: topk's choice


def test_compare_counts_positions_and_perplexities():
    baseline = TeacherForced([[1, 2], [3]], [[-1.0, -1.0], [-1.0]], {}, {})
    candidate = TeacherForced([[1, 0], [3]], [[-1.0, -1.0], [-1.3]], {}, {})
    result = compare(baseline, candidate)
    assert result["positions"] == 3 and result["argmax_agreement"] == pytest.approx(2 / 3, abs=1e-5)
    assert result["perplexity_float32"] == pytest.approx(math.e, abs=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(3.3 / 3), abs=1e-5)
    assert result["perplexity_change_percent"] == pytest.approx(100 * (math.exp(0.1) - 1), abs=1e-3)


@pytest.mark.slow  # two engine starts: ~25 s on 2 busy cores
def test_quality_command_on_the_default_model(tmp_path):
    out = tmp_path / "quality.json"
    bench("quality", "--num-prompts", "2", "--input-len", "16", "--output-json", str(out), *SMALL)
    result = json.loads(out.read_text())
    assert result["dtype"] == "bfloat16" and result["positions"] == 2 * 15
    assert 0.5 <= result["argmax_agreement"] <= 1 and result["perplexity"] > 1
    assert result["operator_fallbacks"] == {"float32": {}, "bfloat16": {}}
    assert result["operators"]["bfloat16"]["rms_norm"] == "cpp fused rms_norm"
    assert result["machine"]["cpu"]["isa"]

"""`heteroserve bench vision` on a tiny Qwen2-VL: both engines measured on a 448x448 image in one run."""

from __future__ import annotations

import json

from heteroserve.entrypoints.cli import main
from tests.model.tiny_vl import save_tiny_vl


def test_vision_bench_reports_both_engines(tmp_path, monkeypatch):
    folder = save_tiny_vl("qwen2_vl", tmp_path).folder
    out = tmp_path / "vision.json"
    argv = ["heteroserve", "bench", "vision", str(folder), "--dtype", "float32", "--max-model-len", "512"]
    argv += ["--output-len", "4", "--repeats", "1", "--output-json", str(out)]
    monkeypatch.setattr("sys.argv", argv)
    main()
    result = json.loads(out.read_text())
    ours, theirs = result["heteroserve"], result["transformers"]
    assert ours["image_grid_thw"] == [1, 32, 32] and ours["image_tokens"] == 256  # 448 / 14 patches, 2x2 merged
    for engine in (ours, theirs):
        assert engine["vision_encoder_s"] > 0 and engine["prefill_s"] > 0 and engine["decode_tokens_per_s"] > 0

"""`heteroserve export onnx`'s options: each bad value is refused with the option's name, before any export."""

from __future__ import annotations

import pytest

from heteroserve.entrypoints.cli import main


def _error(capsys, *argv: str) -> str:
    """The message the command exits with (argparse's usage error or the export's own)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "onnx", *argv])
    code = exit_info.value.code
    return code if isinstance(code, str) else capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--kv-layout", "ring"], "--kv-layout"),
        (["--dtype", "int3"], "--dtype"),
        (["--static", "batch=0"], "--static"),
        (["--static", "width=3"], "--static"),
        (["--static", "seq"], "--static"),
        (["--static", "blocks=4", "--kv-layout", "contiguous"], "--static blocks"),
        (["--block-size", "0"], "--block-size"),
        (["--max-model-len", "0"], "--max-model-len"),
        (["--opset", "7"], "--opset"),
        (["--int4-weights", "awq"], "--int4-weights"),
        (["--vision-grid", "1,16"], "--vision-grid"),
        (["--int4-weights", "matmulnbits", "--dtype", "bfloat16"], "--int4-weights matmulnbits"),
    ],
)
def test_bad_option_is_named(argv, option, capsys, tmp_path):
    message = _error(capsys, "--out", str(tmp_path / "out"), *argv)
    assert option in message, message
    assert not (tmp_path / "out").exists()


def test_out_is_required(capsys):
    assert "--out" in _error(capsys)


def test_options_that_do_not_fit_the_model_are_refused(capsys, tmp_path):
    from tests.model.tiny_models import save_tiny

    tiny = save_tiny("llama_tied", tmp_path)
    message = _error(capsys, str(tiny.folder), "--out", str(tmp_path / "out"), "--vision-grid", "1,4,4")
    assert "--vision-grid: " in message and "has no vision tower" in message
    message = _error(
        capsys, str(tiny.folder), "--out", str(tmp_path / "out"), "--static", "seq=100", "--max-model-len", "64"
    )
    assert "--static seq=100 exceeds --max-model-len 64" in message


def test_engine_settings_read_as_the_engines(capsys):
    """--dtype, --block-size and --max-model-len are EngineArgs' flags: the same choices, defaults and help."""
    import argparse

    from heteroserve.engine.engine_args import EngineArgs

    with pytest.raises(SystemExit):
        main(["export", "onnx", "--help"])
    export_help = " ".join(capsys.readouterr().out.split())
    engine = argparse.ArgumentParser()
    EngineArgs.add_cli_args(engine)
    for action in engine._actions:
        if action.dest in ("dtype", "block_size", "max_model_len"):
            assert " ".join(action.help.split()) in export_help, action.dest
    assert "{auto,float32,bfloat16,float16}" in export_help and "(default: auto)" in export_help


@pytest.mark.parametrize("stored", ["float32", "bfloat16", "float16"])
def test_auto_dtype_is_resolved_as_the_engine_resolves_it(stored, tmp_path):
    from types import SimpleNamespace

    import torch

    from heteroserve.export.onnx_export import resolve_dtype
    from heteroserve.export.options import ExportOptions
    from heteroserve.platforms import resolve_platform

    loaded = SimpleNamespace(source=SimpleNamespace(gguf_file=None), hf_config=SimpleNamespace(dtype=stored))
    engine = resolve_platform("cpu").resolve_dtype("auto", getattr(torch, stored))
    resolved = resolve_dtype(ExportOptions(out=tmp_path, dtype="auto"), loaded)
    assert resolved.dtype == str(engine).removeprefix("torch.")
    gguf = SimpleNamespace(
        source=SimpleNamespace(gguf_file=tmp_path / "m.gguf"), hf_config=SimpleNamespace(dtype=stored)
    )
    assert resolve_dtype(ExportOptions(out=tmp_path, dtype="auto"), gguf).dtype == "float32"  # dequantised tensors
    assert resolve_dtype(ExportOptions(out=tmp_path, dtype="float16"), loaded).dtype == "float16"

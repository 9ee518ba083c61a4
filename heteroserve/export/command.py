"""`heteroserve export onnx MODEL --out DIR`: the export's command line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from heteroserve.engine.engine_args import EngineArgs
from heteroserve.export.options import INT4_WEIGHTS, KV_LAYOUTS, ExportOptions, parse_grid, parse_static
from heteroserve.help_format import DefaultsHelpFormatter


def add_export_parser(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser("export", help="export a model for other runtimes and graph compilers")
    formats = export.add_subparsers(dest="format", required=True)
    onnx = formats.add_parser(
        "onnx",
        help="a prefill and a decode ONNX graph with the KV cache as inputs and outputs, and config.json",
        formatter_class=DefaultsHelpFormatter,
    )
    onnx.add_argument("model", nargs="?", help="checkpoint folder, GGUF file or cached Hugging Face id (default model)")
    onnx.add_argument("--out", required=True, type=Path, help="the folder to write the graphs and config.json to")
    EngineArgs.add_cli_arg(
        onnx, "dtype", note="also the KV cache's; auto resolves as the engine's does on this machine's CPU"
    )
    onnx.add_argument("--kv-layout", default="paged", choices=list(KV_LAYOUTS), help="the cache's layout")
    onnx.add_argument("--static", help="fixed sizes for compilers that need them, e.g. batch=8,seq=512,blocks=256")
    EngineArgs.add_cli_arg(onnx, "block_size", note="paged layout only")
    EngineArgs.add_cli_arg(onnx, "max_model_len")
    onnx.add_argument("--opset", type=int, default=18, help="ONNX opset of the graphs")
    onnx.add_argument(
        "--int4-weights",
        default="dequantize",
        choices=list(INT4_WEIGHTS),
        help="4-bit projections stored dense in --dtype (every runtime) or as MatMulNBits (onnxruntime only)",
    )
    onnx.add_argument(
        "--vision-grid",
        help="a Qwen-VL model's vision tower as vision.onnx for images of this patch grid T,H,W (e.g. 1,16,16)",
    )
    onnx.set_defaults(handler=run_export)


def options_from_args(args: argparse.Namespace) -> ExportOptions:
    return ExportOptions(
        out=args.out,
        dtype=args.dtype,
        kv_layout=args.kv_layout,
        static=parse_static(args.static),
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        opset=args.opset,
        int4_weights=args.int4_weights,
        vision_grid=parse_grid(args.vision_grid) if args.vision_grid else None,
    )


def run_export(args: argparse.Namespace) -> None:
    from heteroserve.config import ModelConfig
    from heteroserve.export.onnx_export import export_onnx
    from heteroserve.model.loader import load_model
    from heteroserve.platforms import resolve_platform

    logging.getLogger("onnxscript").setLevel(logging.WARNING)  # the optimizer logs every rule it tries at INFO
    try:
        options = options_from_args(args)
        config = ModelConfig(model=args.model, dtype="float32", max_model_len=args.max_model_len)
        loaded = load_model(config, resolve_platform("cpu"), kernels="reference")
        result = export_onnx(loaded, options)
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"heteroserve export onnx: {exc}")
    if result.matmul_nbits:
        print(f"weights: {result.matmul_nbits} 4-bit projections kept as MatMulNBits")
    if result.dequantized:
        print(f"weights: {', '.join(result.dequantized)} dequantised to {result.config['dtype']}")
        if "Int4Weight" in result.dequantized and options.int4_weights == "dequantize":
            print("  (--int4-weights matmulnbits keeps 4-bit projections compressed, for onnxruntime)")
    if result.config["vision_tower"] == "not exported":
        print("vision tower: not exported (--vision-grid T,H,W exports it for one image grid)")
    for graph in result.config["graphs"].values():
        print(f"wrote {options.out / graph['file']}")
    print(f"wrote {options.out / 'config.json'}")

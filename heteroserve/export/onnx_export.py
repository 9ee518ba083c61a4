"""Traces a loaded decoder into a prefill and a decode ONNX graph, checks them and writes config.json beside them.

torch.onnx's dynamo exporter traces `GraphDecoder` (torch.export), translates it with onnxscript's torchlib and
simplifies the result with onnxscript's optimizer (constant folding, dead code); `onnx.checker` then checks every
graph in full (shape inference included). Compressed weights are stored dequantised, and config.json says so.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from onnx import numpy_helper

from heteroserve.export.graph_inputs import example_inputs, graph_shapes, input_names, output_names
from heteroserve.export.graph_module import GraphDecoder
from heteroserve.export.kv_layout import kv_layout
from heteroserve.export.matmul_nbits import TRANSLATIONS, fits_matmul_nbits
from heteroserve.export.options import ExportOptions
from heteroserve.export.vision_graph import VisionGraph, check_grid
from heteroserve.model.decoder import DecoderModel
from heteroserve.model.loader import LoadedModel, stored_dtype
from heteroserve.platforms import resolve_platform

logger = logging.getLogger(__name__)

CONFIG_FORMAT = "heteroserve-onnx/1"


@dataclass(frozen=True)
class ExportResult:
    config: dict
    dequantized: list[str]  # the compressed weight formats that were stored as dense weights (empty: none)
    matmul_nbits: int  # projections kept 4-bit as MatMulNBits


def _stored_weights(model: DecoderModel) -> list[object]:
    weights = [model.embed_tokens, model.lm_head]
    for layer in model.layers:
        attn = layer.self_attn
        weights += [attn.qkv_proj, attn.o_proj, layer.gate_up_proj, layer.down_proj]
    return [w for w in weights if w is not None]


def compressed_formats(model: DecoderModel, int4_weights: str) -> tuple[list[str], int]:
    """(the compressed weight types the export dequantises, by class name; how many projections stay 4-bit)."""
    compressed = [w for w in _stored_weights(model) if not isinstance(w, torch.Tensor)]
    embedding = model.embed_tokens
    kept = [w for w in compressed if int4_weights == "matmulnbits" and fits_matmul_nbits(w) and w is not embedding]
    return sorted({type(w).__name__ for w in compressed if all(w is not k for k in kept)}), len(kept)


def _tensor_spec(value: onnx.ValueInfoProto) -> dict:
    kind = value.type.tensor_type
    shape = [d.dim_param if d.dim_param else d.dim_value for d in kind.shape.dim]
    return {"name": value.name, "shape": shape, "dtype": onnx.helper.tensor_dtype_to_np_dtype(kind.elem_type).name}


def _graph_spec(path: Path) -> dict:
    proto = onnx.load(str(path), load_external_data=False)
    return {
        "file": path.name,
        "inputs": [_tensor_spec(v) for v in proto.graph.input],
        "outputs": [_tensor_spec(v) for v in proto.graph.output],
    }


def _trace(module: GraphDecoder, loaded: LoadedModel, options: ExportOptions, decode: bool, path: Path) -> None:
    arch = loaded.model.arch
    max_len = options.max_model_len or loaded.max_model_len
    shapes = graph_shapes(options.static, decode, max_len, options.block_size)
    args, dynamic = example_inputs(arch, options.kv_layout, shapes, options.block_size, options.torch_dtype)
    logger.info("tracing the %s graph into %s", "decode" if decode else "prefill", path)
    torch.onnx.export(
        module,
        args,
        str(path),
        dynamo=True,
        input_names=input_names(arch, options.kv_layout),
        output_names=output_names(arch),
        dynamic_shapes=dynamic,
        opset_version=options.opset,
        optimize=True,
        external_data=True,
        custom_translation_table=TRANSLATIONS,
    )


def deduplicate_weights(path: Path) -> None:
    """Stores each distinct weight once: the optimizer folds a reshaped or transposed view of a weight (a tied
    embedding read as the LM head) into a second initializer with the same bytes."""
    proto = onnx.load(str(path))
    first: dict[tuple, str] = {}
    renamed: dict[str, str] = {}
    kept = []
    for tensor in proto.graph.initializer:
        key = (tuple(tensor.dims), tensor.data_type, hashlib.sha256(numpy_helper.to_array(tensor).tobytes()).digest())
        if key in first:
            renamed[tensor.name] = first[key]
        else:
            first[key] = tensor.name
            kept.append(tensor)
    if not renamed:
        return
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(kept)
    for node in proto.graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
    data = path.with_name(path.name + ".data")
    data.unlink()
    onnx.save(proto, str(path), save_as_external_data=True, location=data.name, size_threshold=1024)
    data.chmod(path.stat().st_mode & 0o777)  # onnx creates it private; readable as the graph beside it is


def export_vision(loaded: LoadedModel, options: ExportOptions, path: Path) -> None:
    """The vision tower for `options.vision_grid` as its own graph (static: one image grid)."""
    encoder = loaded.vision
    if options.torch_dtype != encoder.dtype:
        encoder = copy.deepcopy(encoder).to(options.torch_dtype)
    graph = VisionGraph(encoder, options.vision_grid).eval()
    patches = torch.zeros((graph.num_patches, graph.patch_features), dtype=options.torch_dtype)
    logger.info("tracing the vision tower for grid %s into %s", options.vision_grid, path)
    torch.onnx.export(
        graph,
        (patches,),
        str(path),
        dynamo=True,
        input_names=["pixel_values"],
        output_names=["image_embeds"],
        opset_version=options.opset,
        optimize=True,
        external_data=True,
    )


def derive_decode(prefill: Path, decode: Path) -> None:
    """The decode graph as the dynamic prefill graph with one row per sequence: the same nodes and the same weights
    file (tracing a 30-layer model twice costs minutes; reading its weights twice, gigabytes)."""
    proto = onnx.load(str(prefill), load_external_data=False)
    del proto.graph.value_info[:]  # intermediate shapes mention the seq axis; the checker infers them again
    for value in [*proto.graph.input, *proto.graph.output]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param == "seq":
                dim.Clear()
                dim.dim_value = 1
    onnx.save(proto, str(decode))


def resolve_dtype(options: ExportOptions, loaded: LoadedModel) -> ExportOptions:
    """--dtype auto as the engine resolves it on this machine's CPU: the checkpoint's dtype where the CPU computes
    it, else float32 (a graph needs one concrete dtype)."""
    if options.dtype != "auto":
        return options
    dtype = resolve_platform("cpu").resolve_dtype("auto", stored_dtype(loaded.source, loaded.hf_config))
    return dataclasses.replace(options, dtype=str(dtype).removeprefix("torch."))


def export_onnx(loaded: LoadedModel, options: ExportOptions) -> ExportResult:
    """Writes prefill.onnx and decode.onnx (their weights in .data files beside them), config.json and the
    tokenizer into `options.out`."""
    options = resolve_dtype(options, loaded)
    model = loaded.model
    if not isinstance(model, DecoderModel) or not model.has_lm_head:
        raise ValueError("export onnx: only decoder models that generate text can be exported (not pooling models)")
    max_len = options.max_model_len or loaded.max_model_len
    if options.static.get("seq", 0) > max_len:
        raise ValueError(f"--static seq={options.static['seq']} exceeds --max-model-len {max_len}")
    if max_len > model.rotary.cos.shape[0]:
        raise ValueError(f"--max-model-len {max_len} exceeds the model's {model.rotary.cos.shape[0]} rotary positions")
    if options.vision_grid is not None:
        if loaded.vision is None:
            raise ValueError(f"--vision-grid: {loaded.source.name} has no vision tower")
        check_grid(loaded.vision, options.vision_grid)
    options.out.mkdir(parents=True, exist_ok=True)
    dequantized, matmul_nbits = compressed_formats(model, options.int4_weights)
    module = GraphDecoder(model, options.torch_dtype, kv_layout(options.kv_layout), options.int4_weights).eval()
    prefill, decode = options.out / "prefill.onnx", options.out / "decode.onnx"
    with torch.no_grad():
        _trace(module, loaded, options, decode=False, path=prefill)
        deduplicate_weights(prefill)
        if options.static:  # a static prefill graph may hold its row count as constants: trace one row
            _trace(module, loaded, options, decode=True, path=decode)
            deduplicate_weights(decode)
        else:
            derive_decode(prefill, decode)
        if options.vision_grid is not None:
            export_vision(loaded, options, options.out / "vision.onnx")
    graphs = {"prefill": prefill, "decode": decode}
    if options.vision_grid is not None:
        graphs["vision"] = options.out / "vision.onnx"
    for path in graphs.values():
        onnx.checker.check_model(str(path), full_check=True)
    graphs = {name: _graph_spec(path) for name, path in graphs.items()}
    vision_tower = None
    if loaded.vision is not None:
        vision_tower = (
            "not exported" if options.vision_grid is None else {"graph": "vision", "grid": options.vision_grid}
        )
    tokenizer = None
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(options.out / "tokenizer")
        tokenizer = "tokenizer"
    arch = model.arch
    config = {
        "format": CONFIG_FORMAT,
        "model": loaded.source.name,
        "model_type": arch.model_type,
        "dtype": options.dtype,
        "kv_layout": options.kv_layout,
        "block_size": options.block_size if options.kv_layout == "paged" else None,
        "max_model_len": max_len,
        "static": options.static,
        "num_layers": arch.num_layers,
        "num_kv_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "vocab_size": arch.vocab_size,
        "sliding_windows": [layer.sliding_window for layer in arch.layers],
        "opset": options.opset,
        "weights": {
            "dtype": options.dtype,
            "dequantized_from": dequantized,
            "matmul_nbits_projections": matmul_nbits,
            "note": "compressed weights are stored dequantised" if dequantized else "weights as loaded",
        },
        "vision_tower": vision_tower,
        "tokenizer": tokenizer,
        "eos_token_id": loaded.eos_token_id,
        "padding": "rows with slot_mapping -1 (paged) or position -1 (contiguous) write nothing and are ignored",
        "graphs": graphs,
    }
    (options.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ExportResult(config, dequantized, matmul_nbits)

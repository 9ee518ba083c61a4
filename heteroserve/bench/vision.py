"""`heteroserve bench vision MODEL`: one image + question through a vision-language model, ours vs transformers.

Reports, for both engines on the same pixels and token ids: the vision-encoder time for the image, the
prefill time (vision encoder included, as a user waits for it) and the decode rate. Medians over
`--repeats` runs after a warm-up; prefix caching is off so every run really prefills.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from PIL import Image

from heteroserve.engine.engine_args import EngineArgs
from heteroserve.engine.llm_engine import LLMEngine
from heteroserve.platforms.cpu.platform import process_threads, torch_at_process_threads
from heteroserve.sampling_params import RequestOutputKind, SamplingParams

QUESTION = "Describe this image."


def _median(runs: list[float]) -> float:
    return statistics.median(runs)


def _prompt(engine: LLMEngine, side: int) -> tuple[list[int], Image.Image]:
    pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    picture = Image.fromarray(pixels)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = engine.model.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return engine.model.tokenizer.encode(text, add_special_tokens=False), picture


def _ours(engine: LLMEngine, ids: list[int], picture: Image.Image, output_len: int, repeats: int) -> dict:
    expanded, mm = engine.processor.image_processor.process(ids, [picture])
    image = mm.images[0]
    encoder = engine.runner.images.encoder
    encode, prefill, decode = [], [], []
    for run in range(repeats + 1):
        start = time.perf_counter()
        encoder(image.pixel_values, image.grid_thw)
        encoded = time.perf_counter() - start
        params = SamplingParams(
            temperature=0, max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        start = time.perf_counter()
        engine.add_request(f"vision-{run}", {"prompt_token_ids": ids, "multi_modal_data": {"image": picture}}, params)
        stamps = []
        while engine.has_unfinished_requests():
            if engine.step():
                stamps.append(time.perf_counter())
        if run:  # the first run warms up
            encode.append(encoded)
            prefill.append(stamps[0] - start)
            decode.append((output_len - 1) / (stamps[-1] - stamps[0]))
    return {
        "vision_encoder_s": _median(encode),
        "prefill_s": _median(prefill),
        "decode_tokens_per_s": _median(decode),
        "prompt_tokens": len(expanded),
        "image_tokens": image.placeholder.length,
        "image_grid_thw": list(image.grid_thw),
    }


@torch.inference_mode()
def _transformers(folder: str, engine: LLMEngine, ids: list[int], picture: Image.Image, output_len: int, repeats: int):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=engine.model.dtype).eval()
    model.generation_config.eos_token_id = None
    expanded, mm = engine.processor.image_processor.process(ids, [picture])
    image = mm.images[0]
    input_ids = torch.tensor([expanded])
    grid = torch.tensor([image.grid_thw])
    inputs = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": image.pixel_values.to(engine.model.dtype),
        "image_grid_thw": grid,
        "mm_token_type_ids": (input_ids == engine.processor.image_processor.image_token_id).int(),
    }
    encode, prefill, decode = [], [], []
    for run in range(repeats + 1):
        start = time.perf_counter()
        model.model.visual(inputs["pixel_values"], grid_thw=grid)
        encoded = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
        total = time.perf_counter() - start
        if run:
            encode.append(encoded)
            prefill.append(first)
            decode.append((output_len - 1) / max(total - first, 1e-9))
    return {"vision_encoder_s": _median(encode), "prefill_s": _median(prefill), "decode_tokens_per_s": _median(decode)}


def run_vision_bench(args: argparse.Namespace) -> dict:
    import json

    if args.mm_processor_kwargs is None:  # keep the test image at its size (the processor would shrink it)
        args.mm_processor_kwargs = {"max_pixels": args.image_size**2}
    args.enable_prefix_caching = False
    engine = LLMEngine(EngineArgs.from_cli_args(args, args.model).create_engine_config())
    if engine.processor.image_processor is None:
        raise SystemExit(f"{args.model} is not a vision-language model")
    ids, picture = _prompt(engine, args.image_size)
    result = {
        "model": str(args.model),
        "image_size": args.image_size,
        "output_len": args.output_len,
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "threads": process_threads(),
        "heteroserve": _ours(engine, ids, picture, args.output_len, args.repeats),
    }
    if not args.no_peer:
        with torch_at_process_threads():
            result["transformers"] = _transformers(args.model, engine, ids, picture, args.output_len, args.repeats)
    result["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    print(json.dumps(result, indent=2))
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(result, indent=2) + "\n")
    return result

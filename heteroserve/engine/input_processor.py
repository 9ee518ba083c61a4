"""What a prompt and its parameters become before the scheduler sees them: tokens, images, checks, a grammar.

vLLM's `Processor` beside `EngineCore`: LLMEngine adds, steps and aborts; everything that reads a request's input
and can refuse it lives here, so a bad request is refused before any part of it is queued. Thread-safe where a
server calls it from threads of its own (tokenizing, pooling prompts, LoRA checks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from heteroserve.config import REASONING_FORMATS, EngineConfig
from heteroserve.engine.pooling_tokenizer import PoolingTokenizer
from heteroserve.lora.peft_adapter import inspect_adapter
from heteroserve.lora.request import LoRARequest
from heteroserve.model.arch import ModelArch
from heteroserve.multimodal.inputs import MultimodalInputs
from heteroserve.multimodal.media import ImageError, MediaPolicy
from heteroserve.multimodal.processor import ImageInputProcessor
from heteroserve.pooling_params import PoolingParams
from heteroserve.sampling_params import SamplingParams
from heteroserve.structured_output.grammar_compiler import GrammarCompiler
from heteroserve.structured_output.reasoning_markers import ReasoningMarkers, reasoning_markers
from heteroserve.worker.worker import ModelInfo

PromptInput = str | Sequence[int] | Mapping[str, object]


@dataclass
class GenerationInput:
    """A generation request ready to queue: its tokens (image placeholders expanded), its parameters with the
    bad words' token ids and the model's extra end tokens filled in, and its compiled grammar."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams
    multimodal: MultimodalInputs | None
    grammar: str | None  # the compiled grammar's key (GrammarCompiler.grammar), None without structured outputs
    reasoning: ReasoningMarkers | None  # where the answer the grammar constrains begins


@dataclass
class PoolingInput:
    text: str | None
    token_ids: list[int]
    token_type_ids: list[int] | None
    params: PoolingParams


class InputProcessor:
    def __init__(self, config: EngineConfig, model: ModelInfo) -> None:
        self.config = config
        self.model = model
        self.tokenizer = model.tokenizer
        self.media = MediaPolicy.from_config(config.multimodal)
        self.image_processor = None
        if model.vision_language:
            mm = config.multimodal
            self.image_processor = ImageInputProcessor(
                model.model_folder, model.hf_config, mm.limit_images_per_prompt, mm.min_pixels, mm.max_pixels
            )
        self.pooling_tokenizer = PoolingTokenizer(self.tokenizer, model.pooler_spec, model.max_model_len)
        self._lora_arch = ModelArch.from_hf_config(model.hf_config) if config.lora is not None else None
        self._lora_adapters: dict[int, LoRARequest] = {}  # adapters checked against the model, by id
        self.grammar_compiler: GrammarCompiler | None = None  # built by the first request with a grammar

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults applied, as vLLM does."""
        return SamplingParams(**self.model.sampling_defaults)

    def generation(
        self, prompt: PromptInput, params: SamplingParams | None, lora_request: LoRARequest | None
    ) -> GenerationInput:
        """A generation request's input, checked (ValueError, ImageError naming the problem)."""
        if lora_request is not None:
            self.check_lora(lora_request)
        params = params or self.default_sampling_params()
        text, token_ids = self.tokenize_prompt(prompt)
        token_ids, multimodal = self._process_images(prompt, token_ids)
        if params.bad_words:
            params = params.clone(bad_words_token_ids=self._bad_words_token_ids(params.bad_words))
        self.check_tokens(token_ids, params)
        grammar = self._grammar(params) if params.structured_outputs is not None else None
        reasoning = self._reasoning_markers(text, token_ids) if grammar is not None else None
        if not params.ignore_eos and self.model.extra_eos_token_ids:
            params = params.clone(stop_token_ids=params.stop_token_ids + self.model.extra_eos_token_ids)
        return GenerationInput(text, token_ids, params, multimodal, grammar, reasoning)

    def pooling(self, prompt: PromptInput, params: SamplingParams | PoolingParams | None) -> PoolingInput:
        """A pooling request's input, checked against the model and the step budget it is computed in."""
        model = self.model
        if model.pooler_spec is None:
            raise ValueError(f"{model.model_name} generates text (task generate): it does not pool (embed or score)")
        if not isinstance(params, PoolingParams):
            raise ValueError(
                f"{model.model_name} is a pooling model (task {model.task}): it takes PoolingParams, not SamplingParams"
            )
        model.pooler_spec.check(params)
        tokenized = self.pooling_prompt(prompt, params)
        token_ids = tokenized["prompt_token_ids"]
        self.check_tokens(token_ids, SamplingParams(max_tokens=1))
        budget = self.config.scheduler.max_num_batched_tokens
        if len(token_ids) > budget:
            raise ValueError(
                f"the input has {len(token_ids)} tokens, more than max_num_batched_tokens={budget} (a pooling "
                "model computes an input in one step)"
            )
        return PoolingInput(tokenized["prompt"], token_ids, tokenized.get("token_type_ids"), params)

    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompt_token_ids")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def tokenize_pair(self, text_1: str, text_2: str, truncate_prompt_tokens: int | None = None) -> dict[str, object]:
        """A cross-encoder's prompt for a text pair, as sentence-transformers' CrossEncoder tokenizes it (the
        tokenizer's pair template with BERT's token types, or query and document messages through the chat
        template)."""
        if self.tokenizer is None:
            raise ValueError("scoring text pairs needs the model's tokenizer, and this model has none")
        encoded = self.pooling_tokenizer.pair(text_1, text_2, truncate_prompt_tokens)
        pair = {"prompt": f"{text_1}\n{text_2}", "prompt_token_ids": list(encoded["input_ids"])}
        if "token_type_ids" in encoded:
            pair["token_type_ids"] = list(encoded["token_type_ids"])
        return pair

    def check_lora(self, lora: LoRARequest) -> None:
        """Checks an adapter against the base model (its config, tensor names and shapes; no weights are read),
        once per id: ValueError naming the problem. One id always names one adapter folder."""
        if self.config.lora is None:
            raise ValueError(
                f"LoRA adapter {lora.lora_name!r} asked for, but LoRA is off: start with enable_lora=True "
                "(--enable-lora)"
            )
        known = self._lora_adapters.get(lora.lora_int_id)
        if known is not None:
            if known.lora_path != lora.lora_path:
                raise ValueError(
                    f"lora_int_id {lora.lora_int_id} is adapter {known.lora_name!r} at {known.lora_path}; "
                    f"{lora.lora_name!r} at {lora.lora_path} needs another id"
                )
            return
        inspect_adapter(lora.lora_name, lora.lora_path, self._lora_arch, self.config.lora.max_lora_rank)
        self._lora_adapters[lora.lora_int_id] = lora

    def pooling_prompt(self, prompt: PromptInput, params: PoolingParams) -> dict[str, object]:
        """A pooling request's prompt as token ids ("prompt", "prompt_token_ids" and, for text pairs,
        "token_type_ids"): a text tokenized as sentence-transformers' encode does (PoolingTokenizer), token ids as
        they are, truncated as asked. A server tokenizes in threads of its own instead of the engine's; `pooling`
        accepts the result as is."""
        text, token_ids, token_type_ids = prompt, None, None
        if isinstance(prompt, Mapping):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "token_type_ids"}
            if unknown:
                raise ValueError(f"a pooling prompt takes no {', '.join(sorted(unknown))}")
            if "prompt_token_ids" not in prompt and not isinstance(prompt.get("prompt"), str):
                raise ValueError("a prompt dict needs 'prompt' (a text) or 'prompt_token_ids'")
            text, token_type_ids = prompt.get("prompt"), prompt.get("token_type_ids")
            if "prompt_token_ids" in prompt:
                token_ids = [int(t) for t in prompt["prompt_token_ids"]]
        elif not isinstance(prompt, str):
            text, token_ids = None, [int(t) for t in prompt]
        truncate = params.truncate_prompt_tokens
        if token_ids is None:
            token_ids = list(self.pooling_tokenizer.text(text, truncate)["input_ids"])
        else:
            token_ids = self.pooling_tokenizer.cut(token_ids, truncate)
        token_type_ids = self.pooling_tokenizer.cut(token_type_ids, truncate)
        tokenized: dict[str, object] = {"prompt": text, "prompt_token_ids": token_ids}
        if token_type_ids is not None:
            tokenized["token_type_ids"] = [int(t) for t in token_type_ids]
            if len(token_type_ids) != len(token_ids):
                raise ValueError(f"token_type_ids has {len(token_type_ids)} entries for {len(token_ids)} prompt tokens")
        return tokenized

    def check_tokens(self, token_ids: list[int], params: SamplingParams) -> None:
        """The prompt fits the model, and every token id the request names is in the vocabulary."""
        if not token_ids:
            raise ValueError("the prompt is empty")
        max_model_len, vocab = self.model.max_model_len, self.model.vocab_size
        if len(token_ids) > max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len={max_model_len}")
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"stop token id {bad} is outside the vocabulary [0, {vocab})")
        for name, ids in (
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("bad_words", [t for sequence in params.bad_words_token_ids for t in sequence]),
        ):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")

    def _process_images(self, prompt: PromptInput, token_ids: list[int]) -> tuple[list[int], MultimodalInputs | None]:
        """Expands image placeholders for `{"multi_modal_data": {"image": ...}}` prompts (ImageError if bad)."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, Mapping) else None
        if not data:
            return token_ids, None
        unknown = set(data) - {"image"}
        if unknown:
            raise ValueError(f"unsupported multi_modal_data kinds {sorted(unknown)}; only 'image' is supported")
        images = data.get("image")
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if self.image_processor is None:
            raise ImageError(f"{self.model.model_name} is a text-only model: it does not accept images")
        return self.image_processor.process(token_ids, self.media.load_images(images))

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's token ids as it would appear in the output, at the start of a text and after a space."""
        if self.tokenizer is None:
            raise ValueError("bad_words need the model's tokenizer, and this model has none")
        sequences: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _grammar(self, params: SamplingParams) -> str:
        """The request's compiled grammar (ValueError for a bad schema, regex or grammar, before it is queued)."""
        if self.grammar_compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer, and this model has none")
            model = self.model
            eos = [t for t in [model.eos_token_id, *model.extra_eos_token_ids] if t is not None]
            self.grammar_compiler = GrammarCompiler(self.tokenizer, model.vocab_size, eos)
        return self.grammar_compiler.grammar(params.structured_outputs)

    def _reasoning_markers(self, text: str | None, token_ids: list[int]) -> ReasoningMarkers | None:
        """With a reasoning parser, where the answer that a grammar constrains begins (reasoning_markers.py)."""
        if self.config.reasoning_parser is None:
            return None
        prompt = text if text is not None else self.tokenizer.decode(token_ids[-16:])
        return reasoning_markers(
            REASONING_FORMATS[self.config.reasoning_parser],
            prompt,
            lambda marker: self.tokenizer.encode(marker, add_special_tokens=False),
        )

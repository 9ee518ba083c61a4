"""Request and response bodies of the OpenAI API (the fields heteroserve honours), as pydantic models."""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from heteroserve.entrypoints.openai.structured_fields import StructuredOutputFields
from heteroserve.entrypoints.openai.tools import AssistantToolCall, ChatTool, ToolChoice
from heteroserve.sampling_params import RequestOutputKind, SamplingParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Unhonoured:
    """An OpenAI or vLLM field heteroserve does not implement: why not, and the values that ask for nothing (its
    defaults), which are accepted as if the field were absent."""

    why: str
    harmless: tuple = (None,)

    def asks_nothing(self, value: object) -> bool:
        return any(value == h and type(value) in (type(h), *_SAME_NUMBER.get(type(h), ())) for h in self.harmless)


_SAME_NUMBER = {float: (int,), int: (float,)}  # 1 and 1.0 are one JSON number; true is not 1


class RequestBody(BaseModel):
    """A request body or a part of one, typed as OpenAI's JSON schema is: "3" is not an integer nor "yes" a
    boolean (an integer is a number). Undeclared fields are kept so that none is dropped unseen: one named in
    `unhonoured` is a 400 unless its value asks for nothing, any other is logged and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)
    unhonoured: ClassVar[dict[str, Unhonoured]] = {}

    def undeclared(self, path: str = "") -> Iterator[tuple[str, object, Unhonoured | None]]:
        """(path, value, its Unhonoured or None) for each undeclared field here and in the bodies this one holds."""
        for name, value in (self.model_extra or {}).items():
            yield f"{path}{name}", value, self.unhonoured.get(name)
        for name in type(self).model_fields:
            value = getattr(self, name)
            items = enumerate(value) if isinstance(value, list) else [(None, value)]
            for i, item in items:
                if isinstance(item, RequestBody):
                    yield from item.undeclared(f"{path}{name}{'' if i is None else f'[{i}]'}.")


class StreamOptions(RequestBody):
    unhonoured: ClassVar[dict[str, Unhonoured]] = {
        "include_obfuscation": Unhonoured("stream chunks are not padded", (None, False)),
        "continuous_usage_stats": Unhonoured("usage comes in the last chunk only", (None, False)),
    }

    include_usage: bool = False


# vLLM's extra fields for what heteroserve lacks: beam search, disaggregated serving, extensions, return formats.
_VLLM_UNHONOURED = {
    "guided_decoding_backend": Unhonoured("the grammar engine is llguidance", (None, "auto", "guidance")),
    "guided_whitespace_pattern": Unhonoured("JSON is written with json.dumps' separators"),
    "structural_tag": Unhonoured("structural tags are not supported; use tools or structured_outputs"),
    "use_beam_search": Unhonoured("beam search is not implemented", (None, False)),
    "length_penalty": Unhonoured("it applies to beam search, which is not implemented", (None, 1.0)),
    "watermarking": Unhonoured("watermarking is not implemented", (None, False)),
    "spaces_between_special_tokens": Unhonoured("special tokens are decoded as the tokenizer does", (None, True)),
    "truncate_prompt_tokens": Unhonoured("prompts are not truncated (too long a prompt is a 400)"),
    "truncation_side": Unhonoured("prompts are not truncated (too long a prompt is a 400)"),
    "logprob_token_ids": Unhonoured("logprobs of chosen token ids are not implemented; use logprobs"),
    "request_id": Unhonoured("the server names its requests"),
    "cache_salt": Unhonoured("the prefix cache is not salted per request"),
    "kv_transfer_params": Unhonoured("disaggregated serving is not implemented"),
    "ec_transfer_params": Unhonoured("disaggregated serving is not implemented"),
    "vllm_xargs": Unhonoured("no request extensions are installed"),
    "logits_processors": Unhonoured("custom logits processors are not supported"),
    "repetition_detection": Unhonoured("repetition detection is not implemented"),
    "thinking_token_budget": Unhonoured("a thinking budget is not implemented", (None, -1)),
    "stream_interval": Unhonoured("every token is streamed as it is generated", (None, 1)),
    "return_token_ids": Unhonoured("token ids are returned only as logprob tokens", (None, False)),
    "return_token_offsets": Unhonoured("token offsets are not returned", (None, False)),
    "return_mm_kwargs": Unhonoured("it applies to vLLM's render endpoints", (None, True)),
    "routed_experts_prompt_start": Unhonoured("routed experts are not returned", (None, 0)),
}


class SamplingFields(StructuredOutputFields, RequestBody):
    """Fields shared by completions and chat completions, including vLLM's extra ones."""

    unhonoured: ClassVar[dict[str, Unhonoured]] = _VLLM_UNHONOURED

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]+$")], Annotated[float, Field(ge=-100, le=100)]] | None = None
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)  # vLLM's extra
    bad_words: list[Annotated[str, Field(pattern=r"\S")]] | None = None  # vLLM's extra
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's extra
    # Accepted, not used: labels for the caller's own bookkeeping.
    user: str | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching needs no key
    session_id: str | None = None  # vLLM's

    def sampling_params(
        self, max_tokens: int | None, defaults: dict, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        def pick(name: str, fallback):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(
            n=self.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=self.structured_outputs_params(),
        )


NonEmptyText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    unhonoured: ClassVar[dict[str, Unhonoured]] = {
        **_VLLM_UNHONOURED,
        "suffix": Unhonoured("inserting text (fill-in-the-middle) is not supported", (None, "")),
        "best_of": Unhonoured("best_of > 1 is not supported; use n", (None, 1)),
        "prompt_embeds": Unhonoured("prompts are text or token ids"),
        "add_special_tokens": Unhonoured("prompts get the tokenizer's special tokens", (None, True)),
    }

    prompt: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    max_tokens: int | None = Field(16, ge=0)  # 0: only with echo, to score the prompt
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    return_tokens_as_token_ids: bool = False  # vLLM's extra: logprob tokens as "token_id:N"


class TextPart(RequestBody):
    type: Literal["text"]
    text: str


class ImageURL(RequestBody):
    url: str = Field(description="data:image/...;base64,..., http(s):// (--allow-remote-media) or file://")
    detail: str | None = None  # accepted for OpenAI compatibility; the image processor's budget decides


class ImagePart(RequestBody):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(RequestBody):
    unhonoured: ClassVar[dict[str, Unhonoured]] = {
        "audio": Unhonoured("audio is not supported"),
        "refusal": Unhonoured("refusal messages are not supported; send the text as content"),
        "function_call": Unhonoured("legacy function calls are not supported; use tool_calls"),
    }

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message's answer to that call
    reasoning_content: str | None = None  # an assistant's thinking, when a client sends it back

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(isinstance(p, ImagePart) for p in self.content)


class ChatCompletionRequest(SamplingFields):
    unhonoured: ClassVar[dict[str, Unhonoured]] = {
        **_VLLM_UNHONOURED,
        "audio": Unhonoured("audio output is not supported"),
        "modalities": Unhonoured("the output is text only", (None, ["text"])),
        "prediction": Unhonoured("predicted outputs are not supported"),
        "web_search_options": Unhonoured("web search is not available"),
        "functions": Unhonoured("legacy functions are not supported; use tools"),
        "function_call": Unhonoured("legacy function calls are not supported; use tool_choice", (None, "none")),
        "store": Unhonoured("completions are not stored", (None, False)),
        "service_tier": Unhonoured("there is one service tier", (None, "auto", "default")),
        "verbosity": Unhonoured("verbosity cannot be set"),
        "moderation": Unhonoured("moderation is not available"),
        "prompt_cache_retention": Unhonoured("cached prefixes stay in memory until evicted", (None, "in_memory")),
        "prompt_cache_options": Unhonoured("cache breakpoints and lifetimes cannot be set"),
        "echo": Unhonoured("echo is not supported in chat", (None, False)),
        "add_special_tokens": Unhonoured("the chat template places the special tokens", (None, False)),
        "documents": Unhonoured("documents are not passed to the template"),
        "mm_processor_kwargs": Unhonoured("per-request image processor options are not supported"),
        "media_io_kwargs": Unhonoured("per-request media options are not supported"),
        "return_prompt_text": Unhonoured("the prompt text is not returned", (None, False)),
        "return_tokens_as_token_ids": Unhonoured("chat logprobs name tokens by their text", (None, False)),
        "reasoning_effort": Unhonoured("reasoning effort cannot be set; chat_template_kwargs reach the template"),
        "include_reasoning": Unhonoured("reasoning_content is returned with --reasoning-parser", (None, True)),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's extra: the last message is continued, not closed
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra: more variables for the template
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool = True


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


# vLLM's extra fields of the pooling requests (embeddings, rerank, score) that heteroserve lacks.
_POOLING_UNHONOURED = {
    "request_id": Unhonoured("the server names its requests"),
    "cache_salt": Unhonoured("pooling requests do not use the prefix cache"),
    "mm_processor_kwargs": Unhonoured("inputs are text or token ids"),
    "padding": Unhonoured("inputs are not padded", (None, "do_not_pad")),
    "truncation_side": Unhonoured("truncate_prompt_tokens cuts where the tokenizer's truncation does"),
    "add_special_tokens": Unhonoured("text inputs get the tokenizer's special tokens", (None, True)),
    "additional_data": Unhonoured("no pooling extensions are installed"),
}
_LITTLE_ENDIAN = ("little", "native") if sys.byteorder == "little" else ("little",)


class EmbeddingRequest(RequestBody):
    """POST /v1/embeddings: OpenAI's body and vLLM's extras. One engine request per input."""

    unhonoured: ClassVar[dict[str, Unhonoured]] = {
        **_POOLING_UNHONOURED,
        "messages": Unhonoured("embeddings of chat messages are not supported; send input"),
        "embed_dtype": Unhonoured("base64 embeddings are float32", (None, "float32")),
        "endianness": Unhonoured("base64 embeddings are little-endian", (None, *_LITTLE_ENDIAN)),
    }

    model: str | None = None
    input: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
        | None
    ) = None  # required; None lets an unhonoured `messages` be named first
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM's extra; -1: max_model_len
    normalize: bool | None = None  # vLLM's extra (older name); None: the checkpoint's default
    use_activation: bool | None = None  # vLLM's extra (newer name of normalize for embeddings)
    priority: int = 0  # vLLM's extra


# The rerank and score bodies' fields that heteroserve does not honour (vLLM's, Cohere's, Jina's).
_SCORE_UNHONOURED = {
    **_POOLING_UNHONOURED,
    "use_activation": Unhonoured("scores always pass through the model's activation", (None, True)),
    "activation": Unhonoured("scores always pass through the model's activation", (None, True)),
    "softmax": Unhonoured("scores always pass through the model's activation", (None, True)),
}
ScoreTexts = str | Annotated[list[str], Field(min_length=1)]


class RerankRequest(RequestBody):
    """POST /rerank, /v1/rerank: Jina's and Cohere's shape as vLLM serves it."""

    unhonoured: ClassVar[dict[str, Unhonoured]] = {
        **_SCORE_UNHONOURED,
        "rank_fields": Unhonoured("documents are plain strings"),
        "max_chunks_per_doc": Unhonoured("documents are not chunked; truncate_prompt_tokens cuts long pairs"),
        "max_tokens_per_doc": Unhonoured("documents are not truncated alone; truncate_prompt_tokens cuts pairs"),
        "instruction": Unhonoured("instructions are not added; put them in the query"),
    }

    model: str | None = None
    query: str
    documents: Annotated[list[str], Field(min_length=1)]
    top_n: int = 0  # <= 0: every document, as vLLM
    return_documents: bool = True  # Jina's and Cohere's; false leaves `document` out of the results
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    user: str | None = None
    priority: int = 0


class ScoreRequest(RequestBody):
    """POST /score, /v1/score: vLLM's. text_1 against text_2 (1:1, 1:N or N:N); newer vLLM also names the two
    sides queries/documents, queries/items or data_1/data_2."""

    unhonoured: ClassVar[dict[str, Unhonoured]] = _SCORE_UNHONOURED
    pair_names: ClassVar[tuple[tuple[str, str], ...]] = (
        ("text_1", "text_2"),
        ("queries", "documents"),
        ("queries", "items"),
        ("data_1", "data_2"),
    )

    model: str | None = None
    text_1: ScoreTexts | None = None
    text_2: ScoreTexts | None = None
    queries: ScoreTexts | None = None
    documents: ScoreTexts | None = None
    items: ScoreTexts | None = None
    data_1: ScoreTexts | None = None
    data_2: ScoreTexts | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    user: str | None = None
    priority: int = 0


def now() -> int:
    return int(time.time())

"""Request and response bodies of the OpenAI API (the fields heteroserve honours), as pydantic models."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from heteroserve.sampling_params import RequestOutputKind, SamplingParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions, including vLLM's extra ones."""

    model_config = ConfigDict(extra="ignore")

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
    user: str | None = None

    def sampling_params(self, max_tokens: int | None, defaults: dict, logprobs: int | None) -> SamplingParams:
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
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )


NonEmptyText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    return_tokens_as_token_ids: bool = False  # vLLM's extra: logprob tokens as "token_id:N"


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str = Field(description="data:image/...;base64,..., http(s):// (--allow-remote-media) or file://")
    detail: str | None = None  # accepted for OpenAI compatibility; the image processor's budget decides


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None

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
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template: str | None = None


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


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def now() -> int:
    return int(time.time())

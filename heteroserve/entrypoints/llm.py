"""The offline API, shaped like vLLM's `LLM` so scripts port by changing the import."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from heteroserve.config import EngineConfig
from heteroserve.engine.engine_args import EngineArgs
from heteroserve.engine.llm_engine import LLMEngine, PromptInput
from heteroserve.lora.request import LoRARequest
from heteroserve.multimodal.chat import split_images
from heteroserve.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from heteroserve.pooling_params import PoolingParams
from heteroserve.sampling_params import RequestOutputKind, SamplingParams

Message = dict[str, object]


class LLM:
    def __init__(self, model: str | None = None, *, allowed_local_media_path: str | None = None, **kwargs: Any) -> None:
        """`kwargs` are EngineArgs' settings, named as vLLM's (max_model_len=, dtype=, block_size=, num_kv_blocks=,
        enable_prefix_caching=, tensor_parallel_size=, ...: each is also a CLI flag, `--max-model-len`); an unknown
        one is a TypeError. The dict-valued ones take vLLM's forms: limit_mm_per_prompt={"image": N},
        mm_processor_kwargs={"min_pixels": ..., "max_pixels": ...}, speculative_config={"method": "ngram",
        "num_speculative_tokens": k}, pooler_config={"pooling_type": "CLS" | "MEAN" | "LAST", "normalize": bool}.
        chat() reads local image files only under allowed_local_media_path (the server's flag of that name)."""
        config = EngineArgs.from_kwargs(model, **kwargs).create_engine_config()
        self._start(config, Path(allowed_local_media_path) if allowed_local_media_path else None)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM from a ready EngineConfig (the CLI builds one from its flags)."""
        llm = cls.__new__(cls)
        llm._start(config, None)
        return llm

    def _start(self, config: EngineConfig, local_media: Path | None) -> None:
        self.engine = LLMEngine(config)
        self._ids = itertools.count()
        self._local_media = local_media

    def shutdown(self) -> None:
        """Stops the worker processes now (they also stop when this object is collected or Python exits)."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.model.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.processor.default_sampling_params()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion with continuous batching; outputs come back in prompt order.
        lora_request: one adapter for every prompt, or one per prompt (None: the base model), as vLLM takes it."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        adapters = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"got {len(adapters)} LoRA requests for {len(prompts)} prompts")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                request_id = str(next(self._ids))
                self.engine.add_request(
                    request_id,
                    prompt,
                    p.clone(output_kind=RequestOutputKind.FINAL_ONLY),
                    priority[i] if priority else 0,
                    lora_request=adapters[i],
                )
                ids.append(request_id)
        except Exception:
            self.engine.abort_request(ids)
            self.engine.step()  # collect the abort outputs so nothing is left behind
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates (image parts included).

        As vLLM's: `continue_final_message` leaves the last message open for the model to go on (with
        add_generation_prompt=False); `chat_template_kwargs` are more variables for the template; `tools` (OpenAI's
        function definitions) go to the template, and the output text is the model's, tool calls unparsed."""
        tokenizer = self.engine.model.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        policy = replace(self.engine.processor.media, allowed_local_path=self._local_media)
        for conversation in conversations:
            conversation, images = split_images(conversation, policy)
            text = tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                tools=tools,
                **(chat_template_kwargs or {}),
            )
            prompt = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def encode(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """A pooling model's raw results (`outputs.data`, a float32 tensor) in prompt order, batched as generate is;
        the default task is the model's (embed for an embedding model, score for a cross-encoder)."""
        prompts = _as_prompt_list(prompts)
        if pooling_params is None:
            task = self.engine.model.task
            pooling_params = PoolingParams(task=task if task != "generate" else "embed")
        params = list(pooling_params) if isinstance(pooling_params, Sequence) else [pooling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} pooling params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, p)
                ids.append(request_id)
        except Exception:
            self.engine.abort_request(ids)
            self.engine.step()
            raise
        return self._run(ids, use_tqdm)

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embeddings (`outputs.embedding`, a list of floats) of an embedding model, in prompt order."""
        params = pooling_params or PoolingParams()
        if params.task != "embed":
            raise ValueError(f"embed takes PoolingParams(task='embed'), got task {params.task!r}")
        if truncate_prompt_tokens is not None:
            params = replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        return [
            EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.outputs.data.tolist()))
            for o in self.encode(prompts, params, use_tqdm)
        ]

    def classify(
        self, prompts: PromptInput | Sequence[PromptInput], use_tqdm: bool = True
    ) -> list[ClassificationRequestOutput]:
        """A sequence classifier's label probabilities (softmax over its labels), in prompt order."""
        return [
            ClassificationRequestOutput(o.request_id, o.prompt_token_ids, ClassificationOutput(o.outputs.data.tolist()))
            for o in self.encode(prompts, PoolingParams(task="classify"), use_tqdm)
        ]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """Relevance of text pairs: one text against each of several (1 -> N) or pairwise (N -> N), as vLLM pairs
        them. A cross-encoder reads each pair at once (its score, e.g. sigmoid of the logit); an embedding model
        embeds both sides and scores their cosine similarity."""
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        if not first or not second:
            raise ValueError("score needs at least one text on each side")
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise ValueError(f"score pairs texts one to one or one to many: got {len(first)} and {len(second)} texts")
        if self.engine.model.task == "score":
            pairs = zip(first, second, strict=True)
            prompts = [self.engine.processor.tokenize_pair(a, b, truncate_prompt_tokens) for a, b in pairs]
            params = PoolingParams(task="score")
            return [
                ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(float(o.outputs.data[0])))
                for o in self.encode(prompts, params, use_tqdm)
            ]
        params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        unique = list(dict.fromkeys(first + second))
        embedded = dict(zip(unique, self.encode(unique, params, use_tqdm), strict=True))
        scores = []
        for a, b in zip(first, second, strict=True):
            left, right = embedded[a], embedded[b]
            similarity = torch.nn.functional.cosine_similarity(left.outputs.data, right.outputs.data, dim=0)
            tokens = left.prompt_token_ids + right.prompt_token_ids
            scores.append(ScoringRequestOutput(right.request_id, tokens, ScoringOutput(float(similarity))))
        return scores

    def _run(self, ids: list[str], use_tqdm: bool) -> list:
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in ids]


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """One prompt (text, token ids or a prompt dict) or a sequence of them, as a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)

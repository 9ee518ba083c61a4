"""The offline API, shaped like vLLM's `LLM` so scripts port by changing the import."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from heteroserve.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    MultimodalConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from heteroserve.engine.llm_engine import LLMEngine, PromptInput
from heteroserve.multimodal.chat import split_images
from heteroserve.outputs import RequestOutput
from heteroserve.sampling_params import RequestOutputKind, SamplingParams

Message = dict[str, object]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        kv_cache_memory_bytes: int | None = None,
        num_kv_blocks: int | None = None,
        gpu_memory_utilization: float | None = None,
        kv_cache_dtype: str = "auto",
        scheduling_policy: str = "fcfs",
        generation_config: str = "auto",
        device: str = "auto",
        kernels: str = "auto",
        quantization: str | None = None,
        seed: int = 0,
        limit_mm_per_prompt: dict[str, int] | None = None,
        mm_processor_kwargs: dict[str, int] | None = None,
        allowed_local_media_path: str | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        distributed_executor_backend: str | None = None,
        nnodes: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        speculative_config: dict | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        """limit_mm_per_prompt={"image": N}, mm_processor_kwargs={"min_pixels": ..., "max_pixels": ...} and
        speculative_config={"method": "ngram", "num_speculative_tokens": k} as in vLLM; chat() reads local image
        files only under allowed_local_media_path; with reasoning_parser ("qwen3", "deepseek_r1") structured
        outputs apply after the model's </think>."""
        pixels = mm_processor_kwargs or {}
        config = EngineConfig(
            model=ModelConfig(model, dtype, max_model_len, seed, quantization, generation_config=generation_config),
            cache=CacheConfig(
                block_size,
                kv_cache_memory_bytes,
                enable_prefix_caching,
                num_kv_blocks,
                gpu_memory_utilization,
                kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, scheduling_policy),
            device=DeviceConfig(device, kernels),
            multimodal=MultimodalConfig(
                (limit_mm_per_prompt or {}).get("image", MultimodalConfig.limit_images_per_prompt),
                pixels.get("min_pixels"),
                pixels.get("max_pixels"),
            ),
            parallel=ParallelConfig(
                tensor_parallel_size,
                pipeline_parallel_size,
                distributed_executor_backend,
                nnodes,
                master_addr=master_addr,
                master_port=master_port,
            ),
            speculative=SpeculativeConfig.from_dict(speculative_config) if speculative_config is not None else None,
            reasoning_parser=reasoning_parser,
        )
        self.engine = LLMEngine(config)
        self._ids = itertools.count()
        self._local_media = Path(allowed_local_media_path) if allowed_local_media_path else None

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM from a ready EngineConfig (the CLI builds one from its flags)."""
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        llm._ids = itertools.count()
        llm._local_media = None
        return llm

    def shutdown(self) -> None:
        """Stops the worker processes now (they also stop when this object is collected or Python exits)."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion with continuous batching; outputs come back in prompt order."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                request_id = str(next(self._ids))
                self.engine.add_request(
                    request_id,
                    prompt,
                    p.clone(output_kind=RequestOutputKind.FINAL_ONLY),
                    priority[i] if priority else 0,
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
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates (image parts included).

        As vLLM's: `continue_final_message` leaves the last message open for the model to go on (with
        add_generation_prompt=False); `chat_template_kwargs` are more variables for the template; `tools` (OpenAI's
        function definitions) go to the template, and the output text is the model's, tool calls unparsed."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        policy = replace(self.engine.media, allowed_local_path=self._local_media)
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
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in ids]

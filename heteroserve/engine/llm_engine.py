"""The synchronous engine: `add_request`, `step`, `abort_request`. The server and `LLM` both drive it."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from heteroserve.config import REASONING_FORMATS, EngineConfig
from heteroserve.core.kv_cache_groups import KVCacheGroups
from heteroserve.core.ngram_proposer import NgramProposer
from heteroserve.core.request import Request, RequestStatus
from heteroserve.core.scheduler import Scheduler, SchedulerStats
from heteroserve.engine.output_processor import OutputProcessor, ParentRequest
from heteroserve.engine.pooling_tokenizer import PoolingTokenizer
from heteroserve.executor import make_executor
from heteroserve.lora.peft_adapter import inspect_adapter
from heteroserve.lora.request import LoRARequest
from heteroserve.model.arch import ModelArch
from heteroserve.multimodal.inputs import MultimodalInputs
from heteroserve.multimodal.media import ImageError, MediaPolicy
from heteroserve.multimodal.processor import ImageInputProcessor
from heteroserve.outputs import PoolingOutput, PoolingRequestOutput, RequestMetrics, RequestOutput
from heteroserve.pooling_params import PoolingParams
from heteroserve.sampling_params import SamplingParams
from heteroserve.structured_output.grammar_compiler import GrammarCompiler
from heteroserve.structured_output.manager import StructuredOutputManager
from heteroserve.structured_output.reasoning_markers import ReasoningMarkers, reasoning_markers

logger = logging.getLogger(__name__)

PromptInput = str | Sequence[int] | Mapping[str, object]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = make_executor(config)  # loads the model where it runs (this process or workers)
        info = self.executor.model_info
        self.model_name = info.model_name
        self.tokenizer = info.tokenizer
        self.hf_config = info.hf_config
        self.dtype = info.dtype
        self.kv_cache_dtype = info.kv_cache_dtype
        self.max_model_len = info.max_model_len
        self.eos_token_id = info.eos_token_id
        self.extra_eos_token_ids = info.extra_eos_token_ids
        self.sampling_defaults = info.sampling_defaults
        self.vocab_size = info.vocab_size
        self.weight_bytes = info.weight_bytes
        self.task = info.task
        self.pooler_spec = info.pooler_spec
        pooling = self.pooler_spec is not None
        if pooling and config.speculative is not None:
            raise ValueError("speculative decoding is for text generation; a pooling model generates no tokens")
        scheduled_for = (config.scheduler.max_model_len, config.scheduler.pooling)
        if scheduled_for != (info.max_model_len, pooling):
            raise ValueError(
                f"the scheduler is configured for max_model_len={scheduled_for[0]}, pooling={scheduled_for[1]}, "
                f"but the model loaded as max_model_len={info.max_model_len}, pooling={pooling}: build the "
                "config with EngineArgs(...).create_engine_config(), which reads both from the checkpoint"
            )
        # A pooling request's hidden states are all needed (and an encoder's keys are bidirectional): no prefix reuse.
        prefix_caching = config.cache.enable_prefix_caching and not pooling
        kv_cache = KVCacheGroups(info.kv_groups, config.cache.block_size, prefix_caching)
        proposer = NgramProposer(config.speculative) if config.speculative is not None else None
        self.scheduler = Scheduler(config.scheduler, kv_cache, proposer)
        self.outputs = OutputProcessor(self.tokenizer)
        self.media = MediaPolicy.from_config(config.multimodal)
        self.image_processor = None
        if info.vision_language:
            mm = config.multimodal
            self.image_processor = ImageInputProcessor(
                info.model_folder, info.hf_config, mm.limit_images_per_prompt, mm.min_pixels, mm.max_pixels
            )
        self._children: dict[str, list[str]] = {}  # user request id -> engine request ids (n > 1)
        self._structured: StructuredOutputManager | None = None  # built by the first request with a grammar
        self._pending: list[RequestOutput] = []  # outputs of aborted requests, reported by the next step
        self._pooling_prompts: dict[str, str | None] = {}  # queued pooling requests -> their prompt text
        self.pooling_tokenizer = PoolingTokenizer(self.tokenizer, self.pooler_spec, self.max_model_len)
        self._lora_arch = ModelArch.from_hf_config(self.hf_config) if config.lora is not None else None
        self._lora_adapters: dict[int, LoRARequest] = {}  # adapters checked against the model, by id
        full = info.kv_groups[0]  # the full-attention layers' group where there is one
        tokens = full.num_blocks * config.cache.block_size
        parallel = config.parallel
        if pooling:
            spec = self.pooler_spec
            logger.info(
                "model %s on %s (%s): pooling model, task %s (%s pooling%s), max_model_len=%d, %d tokens per step",
                self.model_name,
                self.platform.name,
                str(self.dtype).removeprefix("torch."),
                spec.task,
                spec.pooling_type,
                ", normalised" if spec.normalize and spec.task == "embed" else "",
                self.max_model_len,
                config.scheduler.max_num_batched_tokens,
            )
            return
        logger.info(
            "model %s on %s x%d (tp=%d, pp=%d, %s): KV cache (%s) of %d blocks x %d tokens = %d tokens, "
            "%.1fx concurrency at max_model_len=%d",
            self.model_name,
            self.platform.name,
            parallel.world_size,
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            str(self.dtype).removeprefix("torch."),
            str(self.kv_cache_dtype).removeprefix("torch."),
            full.num_blocks,
            config.cache.block_size,
            tokens,
            tokens / self.max_model_len,
            self.max_model_len,
        )
        for group in info.kv_groups:
            if group.sliding_window is not None:
                logger.info(
                    "KV cache of the layers with a %d-token window: %d blocks, each request holding only its window's",
                    group.sliding_window,
                    group.num_blocks,
                )

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults applied, as vLLM does."""
        return SamplingParams(**self.sampling_defaults)

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

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | PoolingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validates and queues a request; a bad request raises ValueError and leaves the others untouched.

        Every check, each n > 1 sample's included, runs before anything is queued, so a refused request leaves
        no part of itself behind to run. A pooling model takes PoolingParams, a generating one SamplingParams.
        lora_request: the LoRA adapter to run under (checked against the model the first time its id is seen)."""
        if self.pooler_spec is not None or isinstance(params, PoolingParams):
            if lora_request is not None:
                raise ValueError("LoRA adapters apply to text generation, not to pooling requests")
            self._add_pooling_request(request_id, prompt, params, priority, arrival_time)
            return
        if lora_request is not None:
            self.check_lora(lora_request)
        params = params or self.default_sampling_params()
        text, token_ids = self.tokenize_prompt(prompt)
        token_ids, multimodal = self._process_images(prompt, token_ids)
        if params.bad_words:
            params = params.clone(bad_words_token_ids=self._bad_words_token_ids(params.bad_words))
        self._validate(request_id, token_ids, params)
        grammar = self._grammar(params) if params.structured_outputs is not None else None
        reasoning = self._reasoning_markers(text, token_ids) if grammar is not None else None
        if not params.ignore_eos and self.extra_eos_token_ids:
            params = params.clone(stop_token_ids=params.stop_token_ids + self.extra_eos_token_ids)
        arrival = arrival_time or time.time()
        extras: dict[str, object] = {"lora_request": lora_request}
        if multimodal:
            extras.update(multimodal=multimodal, image_placeholders=multimodal.placeholders)
        if params.n == 1:
            requests = [Request(request_id, token_ids, params, self.eos_token_id, priority, arrival, **extras)]
            parent = None
        else:
            requests = self._samples(request_id, token_ids, params, priority, arrival, extras)
            parent = ParentRequest(request_id, params.n)
        for i, request in enumerate(requests):
            self._add(request, text, i, parent)
            if grammar is not None:
                self._structured.add(request.request_id, grammar, reasoning)
        if parent is not None:
            self._children[request_id] = [r.request_id for r in requests]

    def check_lora(self, lora: LoRARequest) -> None:
        """Checks an adapter against the base model (its config, tensor names and shapes; no weights are read),
        once per id: ValueError naming the problem. One id always names one adapter folder. Thread-safe."""
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
        they are, truncated as asked. Thread-safe, so a server tokenizes in threads of its own instead of the
        engine's; add_request accepts the result as is."""
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

    def _add_pooling_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | PoolingParams | None,
        priority: int,
        arrival_time: float | None,
    ) -> None:
        if self.pooler_spec is None:
            raise ValueError(f"{self.model_name} generates text (task generate): it does not pool (embed or score)")
        if not isinstance(params, PoolingParams):
            raise ValueError(
                f"{self.model_name} is a pooling model (task {self.task}): it takes PoolingParams, not SamplingParams"
            )
        self.pooler_spec.check(params)
        tokenized = self.pooling_prompt(prompt, params)
        token_ids = tokenized["prompt_token_ids"]
        self._validate(request_id, token_ids, SamplingParams(max_tokens=1))
        budget = self.config.scheduler.max_num_batched_tokens
        if len(token_ids) > budget:
            raise ValueError(
                f"the input has {len(token_ids)} tokens, more than max_num_batched_tokens={budget} (a pooling "
                "model computes an input in one step)"
            )
        request = Request(
            request_id,
            token_ids,
            SamplingParams(max_tokens=1),
            priority=priority,
            arrival_time=arrival_time or time.time(),
            pooling_params=params,
            token_type_ids=tokenized.get("token_type_ids"),
        )
        self.scheduler.add_request(request)
        self._pooling_prompts[request_id] = tokenized["prompt"]

    def _samples(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
        arrival: float,
        extras: dict[str, object],
    ) -> list[Request]:
        """The n engine requests of an n > 1 request: sample i uses seed + i, and the later ones wait for the
        first one's prompt blocks. All are built (and checked) before the caller queues any."""
        samples: list[Request] = []
        for i in range(params.n):
            sample_id = f"{i}_{request_id}"
            if sample_id in self.scheduler.requests or sample_id in self._children:
                raise ValueError(f"request id {sample_id!r} (sample {i} of {request_id!r}) is already in use")
            seed = None if params.seed is None else params.seed + i
            try:
                sample_params = params.clone(n=1, seed=seed)
            except ValueError as exc:
                raise ValueError(f"n={params.n}: sample {i} (which uses seed + {i}) is invalid: {exc}") from exc
            sample = Request(sample_id, token_ids, sample_params, self.eos_token_id, priority, arrival, **extras)
            sample.prefix_leader = samples[0] if samples else None
            samples.append(sample)
        return samples

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
            raise ImageError(f"{self.model_name} is a text-only model: it does not accept images")
        return self.image_processor.process(token_ids, self.media.load_images(images))

    def _add(self, request: Request, text: str | None, index: int = 0, parent: ParentRequest | None = None) -> None:
        self.scheduler.add_request(request)
        self.outputs.add(request, text, index, parent)

    def _validate(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.scheduler.requests or request_id in self._children:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len={self.max_model_len}")
        vocab = self.vocab_size
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
        if self._structured is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer, and this model has none")
            eos = [t for t in [self.eos_token_id, *self.extra_eos_token_ids] if t is not None]
            self._structured = StructuredOutputManager(GrammarCompiler(self.tokenizer, self.vocab_size, eos))
        return self._structured.compiler.grammar(params.structured_outputs)

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

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Stops requests at once and frees their blocks; each gets a final output with reason 'abort'."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            for engine_id in self._children.get(request_id, [request_id]):
                if engine_id in self._pooling_prompts:  # a pooling request has no partial result: data None
                    request = self.scheduler.finish_request(engine_id, RequestStatus.FINISHED_ABORTED)
                    if request is not None:
                        self._pending.append(self._pooling_output(request, None))
                    continue
                if self.scheduler.finish_request(engine_id, RequestStatus.FINISHED_ABORTED) is not None:
                    self._release(engine_id)
                    output = self.outputs.make_output(engine_id)
                    if output is not None:
                        self._pending.append(output)
            self._forget_parent(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending)

    def is_waiting(self, request_id: str) -> bool:
        """Whether a queued request has yet to be scheduled at all (for n > 1: none of its samples has been; a
        sample that is gone has finished, so it ran). A preempted request has run, so it is not waiting in this
        sense; an unknown or finished one is not either."""
        requests = [self.scheduler.requests.get(i) for i in self._children.get(request_id, [request_id])]
        return all(r is not None and r.first_scheduled_time is None for r in requests)

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        outputs, self._pending = self._pending, []
        scheduled = self.scheduler.schedule()
        if not scheduled.scheduled:
            return outputs
        if self._structured is not None:
            # The grammars' masks are computed while the model runs; the sampler waits for them.
            sampling = [item.request.request_id for item in scheduled.scheduled if item.samples]
            scheduled.token_bitmasks = self._structured.start_bitmasks(sampling)
        results = self.executor.execute(scheduled)
        known = {item.request.request_id: item.request.num_tokens for item in scheduled.scheduled}
        self.scheduler.update_from_output(scheduled, {rid: r.token_ids for rid, r in results.items() if r.token_ids})
        for item in scheduled.scheduled:
            request = item.request
            rid = request.request_id
            result = results[rid]
            if request.pooling_params is not None:
                outputs.append(self._pooling_output(request, result.pooled))
                continue
            if result.prompt_logprobs:
                self.outputs.add_prompt_logprobs(rid, result.prompt_logprobs)
            appended = request.num_tokens - known[rid]  # fewer than sampled where a stop rule ended the request
            if appended == 0:
                continue
            error = self._structured.advance(rid, request.token_ids[known[rid] :]) if self._structured else None
            if error is not None:
                if self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR) is None:
                    request.status = RequestStatus.FINISHED_ERROR  # a stop rule had ended it in this step
                request.error = error
                appended = 0  # tokens the grammar refused are not reported as text
            for i in range(appended):
                num_output = known[rid] + i + 1 - request.num_prompt_tokens
                if self.outputs.add_token(rid, result.token_ids[i], result.logprobs[i], num_output):
                    self.scheduler.stop_at(request, known[rid] + i + 1)  # a stop string ends the output here
                    break
            if request.status.finished:
                self._release(rid)
            output = self.outputs.make_output(rid)
            if output is not None:
                outputs.append(output)
                if output.finished:
                    self._forget_parent(output.request_id)
        return outputs

    def _pooling_output(self, request: Request, pooled) -> PoolingRequestOutput:
        self._release(request.request_id)
        metrics = RequestMetrics(
            request.arrival_time,
            request.first_scheduled_time,
            request.finished_time,
            request.finished_time,
        )
        return PoolingRequestOutput(
            request.request_id,
            request.prompt_token_ids,
            PoolingOutput(pooled),
            prompt=self._pooling_prompts.pop(request.request_id, None),
            metrics=metrics,
        )

    def _release(self, request_id: str) -> None:
        self.executor.release(request_id)
        if self._structured is not None:
            self._structured.remove(request_id)

    def _forget_parent(self, request_id: str) -> None:
        children = self._children.get(request_id)
        if children is not None and not any(c in self.scheduler.requests for c in children):
            del self._children[request_id]

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    @property
    def platform(self):
        """The device platform (with worker processes, the engine process's own copy of it)."""
        return self.executor.platform

    @property
    def runner(self):
        """The model runner, for looking inside a single-rank engine (tests, the bench)."""
        worker = getattr(self.executor, "worker", None)
        if worker is None:
            raise AttributeError("the model runs in worker processes; no runner in this process")
        return worker.runner

    def shutdown(self) -> None:
        """Stops the workers (worker processes or Ray actors); the engine cannot step afterwards."""
        self.executor.shutdown()
        if self._structured is not None:
            self._structured.shutdown()

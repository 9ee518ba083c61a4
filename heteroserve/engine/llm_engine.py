"""The synchronous engine: `add_request`, `step`, `abort_request`. The server and `LLM` both drive it."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from heteroserve.config import EngineConfig
from heteroserve.core.kv_cache_groups import KVCacheGroups
from heteroserve.core.ngram_proposer import NgramProposer
from heteroserve.core.request import Request, RequestStatus
from heteroserve.core.scheduler import Scheduler, SchedulerStats
from heteroserve.engine.input_processor import InputProcessor, PromptInput
from heteroserve.engine.output_processor import OutputProcessor, ParentRequest
from heteroserve.executor import make_executor
from heteroserve.lora.request import LoRARequest
from heteroserve.outputs import PoolingOutput, PoolingRequestOutput, RequestMetrics, RequestOutput
from heteroserve.pooling_params import PoolingParams
from heteroserve.sampling_params import SamplingParams
from heteroserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class LLMEngine:
    """Adds, steps and aborts requests. `model` is what the workers loaded (ModelInfo); `processor` turns a
    prompt and its parameters into what the scheduler queues (tokens, images, checks, grammars)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = make_executor(config)  # loads the model where it runs (this process or workers)
        self.model = info = self.executor.model_info
        pooling = info.pooler_spec is not None
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
        speculative = config.speculative
        proposer = NgramProposer(speculative) if speculative is not None and speculative.method == "ngram" else None
        lookahead = speculative.lookahead_slots if speculative is not None else 0
        self.scheduler = Scheduler(config.scheduler, kv_cache, proposer, lookahead)
        self.processor = InputProcessor(config, info)
        self.outputs = OutputProcessor(info.tokenizer)
        self._children: dict[str, list[str]] = {}  # user request id -> engine request ids (n > 1)
        self._structured: StructuredOutputManager | None = None  # built by the first request with a grammar
        self._pending: list[RequestOutput] = []  # outputs of aborted requests, reported by the next step
        self._pooling_prompts: dict[str, str | None] = {}  # queued pooling requests -> their prompt text
        full = info.kv_groups[0]  # the full-attention layers' group where there is one
        tokens = full.num_blocks * config.cache.block_size
        parallel = config.parallel
        if pooling:
            spec = info.pooler_spec
            logger.info(
                "model %s on %s (%s): pooling model, task %s (%s pooling%s), max_model_len=%d, %d tokens per step",
                info.model_name,
                self.platform.name,
                str(info.dtype).removeprefix("torch."),
                spec.task,
                spec.pooling_type,
                ", normalised" if spec.normalize and spec.task == "embed" else "",
                info.max_model_len,
                config.scheduler.max_num_batched_tokens,
            )
            return
        logger.info(
            "model %s on %s x%d (tp=%d, pp=%d, %s): KV cache (%s) of %d blocks x %d tokens = %d tokens, "
            "%.1fx concurrency at max_model_len=%d",
            info.model_name,
            self.platform.name,
            parallel.world_size,
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            str(info.dtype).removeprefix("torch."),
            str(info.kv_cache_dtype).removeprefix("torch."),
            full.num_blocks,
            config.cache.block_size,
            tokens,
            tokens / info.max_model_len,
            info.max_model_len,
        )
        for group in info.kv_groups:
            if group.sliding_window is not None:
                logger.info(
                    "KV cache of the layers with a %d-token window: %d blocks, each request holding only its window's",
                    group.sliding_window,
                    group.num_blocks,
                )

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
        if self.model.pooler_spec is not None or isinstance(params, PoolingParams):
            if lora_request is not None:
                raise ValueError("LoRA adapters apply to text generation, not to pooling requests")
            self._check_id(request_id)
            pooling = self.processor.pooling(prompt, params)
            request = Request(
                request_id,
                pooling.token_ids,
                SamplingParams(max_tokens=1),
                priority=priority,
                arrival_time=arrival_time or time.time(),
                pooling_params=pooling.params,
                token_type_ids=pooling.token_type_ids,
            )
            self.scheduler.add_request(request)
            self._pooling_prompts[request_id] = pooling.text
            return
        self._check_id(request_id)
        given = self.processor.generation(prompt, params, lora_request)
        params, token_ids = given.params, given.token_ids
        arrival = arrival_time or time.time()
        extras: dict[str, object] = {"lora_request": lora_request}
        if given.multimodal:
            extras.update(multimodal=given.multimodal, image_placeholders=given.multimodal.placeholders)
        eos = self.model.eos_token_id
        if params.n == 1:
            requests = [Request(request_id, token_ids, params, eos, priority, arrival, **extras)]
            parent = None
        else:
            requests = self._samples(request_id, token_ids, params, priority, arrival, extras)
            parent = ParentRequest(request_id, params.n)
        if given.grammar is not None and self._structured is None:
            self._structured = StructuredOutputManager(self.processor.grammar_compiler)
        for i, request in enumerate(requests):
            self._add(request, given.text, i, parent)
            if given.grammar is not None:
                self._structured.add(request.request_id, given.grammar, given.reasoning)
        if parent is not None:
            self._children[request_id] = [r.request_id for r in requests]

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
            sample = Request(sample_id, token_ids, sample_params, self.model.eos_token_id, priority, arrival, **extras)
            sample.prefix_leader = samples[0] if samples else None
            samples.append(sample)
        return samples

    def _add(self, request: Request, text: str | None, index: int = 0, parent: ParentRequest | None = None) -> None:
        self.scheduler.add_request(request)
        self.outputs.add(request, text, index, parent)

    def _check_id(self, request_id: str) -> None:
        if request_id in self.scheduler.requests or request_id in self._children:
            raise ValueError(f"request id {request_id!r} is already in use")

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
        sampled = {rid: r.token_ids for rid, r in results.items() if r.token_ids}
        drafted = None
        if self.scheduler.lookahead_slots:  # the draft model's proposals came with the results
            drafted = {rid: r.draft_token_ids for rid, r in results.items() if r.draft_token_ids}
        self.scheduler.update_from_output(scheduled, sampled, drafted)
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

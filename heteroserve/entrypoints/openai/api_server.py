"""The OpenAI-compatible server: `heteroserve serve` or `python -m heteroserve.entrypoints.openai.api_server`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
import uuid
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import heteroserve
from heteroserve.engine.async_engine import AsyncLLMEngine
from heteroserve.engine.engine_args import EngineArgs
from heteroserve.entrypoints.openai.errors import APIError
from heteroserve.entrypoints.openai.gate import Gate, ServerState, unless_disconnected
from heteroserve.entrypoints.openai.listen_address import bind_listen_socket, is_loopback, page_url, port_number
from heteroserve.entrypoints.openai.lora_modules import LoRAModules, parse_lora_module
from heteroserve.entrypoints.openai.lora_routes import add_lora_routes
from heteroserve.entrypoints.openai.page_routes import add_chat_page_routes
from heteroserve.entrypoints.openai.pooling_routes import add_pooling_routes
from heteroserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
    now,
)
from heteroserve.entrypoints.openai.serving import Admission, ServerSettings, check_fields
from heteroserve.entrypoints.openai.serving_chat import ServingChat
from heteroserve.entrypoints.openai.serving_completion import ServingCompletion
from heteroserve.entrypoints.openai.serving_pooling import require_task
from heteroserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
from heteroserve.lora.request import LoRARequest
from heteroserve.metrics.prometheus import METRICS_PREFIXES, ServerMetrics
from heteroserve.multimodal.media import MediaPolicy
from heteroserve.pooling_params import PoolingParams
from heteroserve.sampling_params import SamplingParams

logger = logging.getLogger("heteroserve.server")
SERVER_PREFILL_TOKENS_PER_STEP = 256
_API_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 429, 500, 503)}
_PROBE_ERRORS = {503: {"model": ErrorResponse}}
_GENERATION_RESPONSES = {
    **_API_ERRORS,
    200: {
        "description": "JSON, or server-sent events with stream=true",
        "content": {"application/json": {}, "text/event-stream": {}},
    },
}


def build_app(
    engine: AsyncLLMEngine,
    settings: ServerSettings,
    api_key: str | None = None,
    allowed_origins: list[str] | None = None,
    log_requests: bool = False,
    allow_lora_updates: bool = False,
    url: str | None = None,
) -> FastAPI:
    app = FastAPI(title="heteroserve", version=heteroserve.__version__)
    state = ServerState()
    app.state.server = state
    app.state.engine = engine
    metrics = ServerMetrics(engine.engine, settings.served_model_names[0], settings.metrics_prefix)
    admission = Admission(settings.max_waiting_requests)  # one count for every route
    app.add_middleware(
        Gate, engine=engine, state=state, api_key=api_key, max_body_bytes=settings.max_request_body_bytes
    )
    if allowed_origins:  # outermost, so a browser's preflight is answered before the key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"])
    _add_error_handlers(app)
    _add_page_and_probe_routes(app, engine, state, metrics)
    completions = ServingCompletion(engine, settings, metrics, admission)
    chats = ServingChat(engine, settings, metrics, admission)
    state.at_drain_timeout += [completions.cut_off_requests, chats.cut_off_requests]
    _add_generation_routes(app, engine, settings, completions, chats, log_requests)
    add_pooling_routes(app, engine, settings, metrics, admission, _API_ERRORS, log_requests)
    add_lora_routes(app, engine, settings, allow_lora_updates, _API_ERRORS)

    @app.on_event("startup")
    async def warm_up():
        task = engine.engine.task
        params = (
            SamplingParams(temperature=0, max_tokens=2, ignore_eos=True) if task == "generate" else PoolingParams(task)
        )
        async for _ in engine.generate(f"warmup-{uuid.uuid4().hex}", {"prompt_token_ids": [1, 2, 3]}, params):
            pass
        state.ready = True
        logger.info("ready: serving %s", ", ".join(settings.served_model_names))
        if url is not None:
            logger.info("chat page and API at %s", url)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every refusal in OpenAI's error shape: ours, pydantic's validation and Starlette's own."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        location = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = location[0] if location else None
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message, param = f"the request body is not valid JSON: {message}", None
        elif param and len({tuple(e.get("loc", ()))[:2] for e in errors}) == 1 and len(errors) > 1:
            message = f"{param}: none of the accepted forms matched ({message})"
        elif param:
            message = f"{'.'.join(location)}: {message}"  # the whole path: structured_outputs.json_schemas
        return APIError(400, message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        """Starlette's own refusals (no such route, a method the route lacks, an unreadable body) in OpenAI's shape."""
        path = request.url.path
        if exc.status_code == 404:
            message = f"there is no route {path}"
        elif exc.status_code == 405:
            message = f"{path} does not accept {request.method} (it accepts {(exc.headers or {}).get('Allow', '')})"
        elif isinstance(exc.__cause__, UnicodeDecodeError):
            message = f"the request body is not UTF-8: {exc.__cause__}"
        else:
            message = str(exc.detail)
        response = APIError(exc.status_code, message).response()
        response.headers.update(exc.headers or {})
        return response


def _add_page_and_probe_routes(
    app: FastAPI, engine: AsyncLLMEngine, state: ServerState, metrics: ServerMetrics
) -> None:
    add_chat_page_routes(app)

    @app.get("/health", responses=_PROBE_ERRORS)
    async def health():
        if not engine.is_alive:
            return APIError(503, f"the engine loop is not running: {engine.dead_error!r}").response()
        return {"status": "ok"}

    @app.get("/health/ready", responses={503: {"description": "loading, draining or failed"}})
    async def ready():
        if state.draining or not state.ready or not engine.is_alive:
            reason = "draining" if state.draining else "loading" if not state.ready else "engine failed"
            return JSONResponse({"status": reason}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": heteroserve.__version__}


def _add_generation_routes(
    app: FastAPI,
    engine: AsyncLLMEngine,
    settings: ServerSettings,
    completions: ServingCompletion,
    chats: ServingChat,
    log_requests: bool,
) -> None:
    """The model cards, completions, chat and the tokenizer's routes."""

    def model_card(name: str, lora: LoRARequest | None = None) -> dict:
        """A LoRA adapter's card names the base model as its parent and its folder as its root, as vLLM's."""
        return {
            "id": name,
            "object": "model",
            "created": now(),
            "owned_by": "heteroserve",
            "root": engine.engine.model_name if lora is None else lora.lora_path,
            "parent": None if lora is None else settings.served_model_names[0],
            "max_model_len": engine.engine.max_model_len,
            "task": engine.engine.task,  # generate, embed or score: which routes serve it
            "capabilities": {"vision": engine.engine.image_processor is not None},  # the chat page's Image button
        }

    @app.get("/v1/models", responses=_API_ERRORS)
    async def models():
        cards = [model_card(name) for name in settings.served_model_names]
        cards += [model_card(lora.lora_name, lora) for lora in settings.lora_modules.adapters()]
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{model_id:path}", responses=_API_ERRORS)
    async def model(model_id: str):
        return model_card(model_id, completions.check_model(model_id))

    @app.post("/v1/completions", responses=_GENERATION_RESPONSES)
    async def create_completion(body: CompletionRequest, request: Request):
        if log_requests:
            logger.info("completion request: %s", body.model_dump_json())
        require_task(completions, body.model, "/v1/completions", ("generate",))
        return await unless_disconnected(request, completions.create(body), completions.client_left)

    @app.post("/v1/chat/completions", responses=_GENERATION_RESPONSES)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        if log_requests:
            logger.info("chat request: %s", body.model_dump_json())
        require_task(chats, body.model, "/v1/chat/completions", ("generate",))
        return await unless_disconnected(request, chats.create(body), chats.client_left)

    @app.post("/tokenize", responses=_API_ERRORS)
    async def tokenize(body: TokenizeRequest):
        completions.check_model(body.model)
        check_fields(body)
        if chats.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        if body.messages is not None:
            options = {"add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs"}
            chat = ChatCompletionRequest(messages=body.messages, **body.model_dump(include=options, exclude_unset=True))
            _, tokens, _ = await chats.render_in_thread(chat)
        elif body.prompt is not None:  # a long prompt takes seconds: off the event loop
            tokens = await asyncio.to_thread(
                chats.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens
            )
        else:
            raise APIError(400, "give either prompt or messages", "prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.engine.max_model_len}

    @app.post("/detokenize", responses=_API_ERRORS)
    async def detokenize(body: DetokenizeRequest):
        completions.check_model(body.model)
        check_fields(body)
        vocab = engine.engine.vocab_size
        if chats.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": await asyncio.to_thread(chats.tokenizer.decode, body.tokens)}


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: readiness turns 503 and new requests are refused, in-flight ones finish
    (bounded by the drain timeout, when the state's at_drain_timeout callbacks run), then uvicorn shuts down and
    the process exits 0."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain_task is not None:  # a second signal: stop now
            super().handle_exit(sig, frame)
            return
        logger.info("received %s: draining", signal.Signals(sig).name)
        self.state.draining = True
        self._drain_task = asyncio.get_event_loop().create_task(self._drain(sig, frame))

    async def _drain(self, sig: int, frame) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        while self.state.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.state.in_flight:
            logger.warning("drain timeout: %d requests still in flight are cut off", self.state.in_flight)
            for cut_off in self.state.at_drain_timeout:
                cut_off()
        self.should_exit = True  # not handle_exit: uvicorn would re-raise the signal and the exit code be -15


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="heteroserve serve",
        description="OpenAI-compatible LLM server",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_server_args(parser)
    return parser


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, help="model (default: the embedded SmolLM2-135M)")
    parser.add_argument("--model", default=None, help="same as the positional MODEL")
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="0.0.0.0")
    group.add_argument("--port", type=port_number, default=8000, help="checked and bound before the model loads")
    group.add_argument("--served-model-name", nargs="+", default=None, help="names clients use (default: the model)")
    group.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    group.add_argument("--chat-template", default=None, help="a Jinja chat template (file path or inline)")
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept chat_template in requests (templates are code the server runs; refused by default)",
    )
    group.add_argument(
        "--chat-template-timeout", type=float, default=5.0, help="seconds one chat template rendering may take"
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": the model decides, and --tool-call-parser finds its calls in the output',
    )
    group.add_argument(
        "--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS), help="the model's tool-call format"
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters served by name (PEFT folders; needs --enable-lora); also vLLM's JSON form",
    )
    group.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora and --api-key)",
    )
    group.add_argument("--allowed-origins", nargs="*", default=None, help="CORS origins, e.g. '*'")
    group.add_argument("--max-waiting-requests", type=int, default=None, help="answer 429 beyond this many waiting")
    group.add_argument(
        "--request-timeout", type=float, default=None, help="seconds a request may take, streamed or not (408)"
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=32 * 1024**2,
        help="larger request bodies answer 413 (the default fits one --max-image-bytes image in base64)",
    )
    group.add_argument(
        "--max-prompts-per-request", type=int, default=256, help="prompts one completion request may hold"
    )
    group.add_argument(
        "--metrics-prefix",
        choices=sorted(METRICS_PREFIXES),
        default="both",
        help="/metrics names: heteroserve:* (our dashboard), vllm:* (vLLM's dashboards, routers, autoscalers) or both",
    )
    group.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight work on SIGTERM")
    group.add_argument("--enable-log-requests", action="store_true", help="log request bodies (prompts included)")
    group.add_argument("--uvicorn-log-level", default="info")
    group.add_argument(
        "--log-level",
        choices=["debug", "info", "warning"],
        default="info",
        help="heteroserve's log level; debug also shows the traceback of a start-up configuration error",
    )
    media = parser.add_argument_group("images in chat requests")
    media.add_argument("--allow-remote-media", action="store_true", help="fetch http(s) image URLs (off: offline)")
    media.add_argument("--allowed-local-media-path", default=None, help="serve file:// images only under this folder")
    media.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        help="fetch remote images only from these hosts, on any address (private ones too); implies "
        "--allow-remote-media, which alone reaches only hosts with public addresses",
    )
    media.add_argument(
        "--media-fetch-timeout",
        type=float,
        default=10.0,
        help="seconds for all of one remote image's fetch (resolution, redirects, body)",
    )
    media.add_argument("--max-image-bytes", type=int, default=20 * 1024**2, help="largest encoded image accepted")
    EngineArgs.add_cli_args(parser)
    # A server's clients wait for their first token: a burst is prefilled in steps of 256 prompt tokens, so the
    # first clients start early (scenario C: TTFT p50 0.63x, same throughput; bench/results/burst_prefill/).
    parser.set_defaults(max_prefill_tokens_per_step=SERVER_PREFILL_TOKENS_PER_STEP)


def run_server(args: argparse.Namespace) -> None:
    """Starts the engine and serves until SIGTERM. A configuration error found while starting (a ValueError, a
    missing file, a taken port) is one line on stderr and exit 2: the user's mistake, not a bug to debug."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(args.log_level.upper())
    try:
        started = _start(args)
    except (ValueError, FileNotFoundError) as exc:
        if args.log_level == "debug":
            raise
        print(f"heteroserve serve: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    engine, server, listen_socket = started
    server.run(sockets=[listen_socket])
    engine.shutdown()


def _start(args: argparse.Namespace) -> tuple[AsyncLLMEngine, DrainingServer, socket.socket]:
    """The engine and the HTTP server on its bound socket, the port bound first so that a taken one is told
    before minutes of loading (a worker node binds nothing, serves the head's ranks and exits here)."""
    listen_socket = bind_listen_socket(args.host, args.port) if args.node_rank == 0 else None
    if listen_socket is not None and not is_loopback(args.host) and args.api_key is None:
        logger.warning(
            "listening on %s, reachable from other machines, without --api-key: anyone who reaches it can use "
            "the model (pass --api-key KEY, or --host 127.0.0.1 for this machine only)",
            args.host,
        )
    model = args.model or args.model_tag
    config = EngineArgs.from_cli_args(args, model).create_engine_config()
    media = MediaPolicy.from_config(
        config.multimodal,
        allow_remote=args.allow_remote_media or bool(args.allowed_media_domains),
        allowed_domains=frozenset(args.allowed_media_domains) if args.allowed_media_domains else None,
        allowed_local_path=Path(args.allowed_local_media_path) if args.allowed_local_media_path else None,
        max_bytes=args.max_image_bytes,
        timeout_s=args.media_fetch_timeout,
    )
    if config.parallel.node_rank > 0:  # a worker node: no engine, no HTTP; it serves the head's ranks
        from heteroserve.executor.worker_process import run_node

        raise SystemExit(run_node(config))
    for name in ("request_timeout", "chat_template_timeout", "max_request_body_bytes", "max_prompts_per_request"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    chat_template = args.chat_template
    if chat_template is not None:
        path = Path(chat_template)
        chat_template = path.read_text() if path.is_file() else chat_template
    if (args.lora_modules or args.allow_runtime_lora_updating) and config.lora is None:
        raise SystemExit("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    if args.allow_runtime_lora_updating and args.api_key is None:
        raise SystemExit("--allow-runtime-lora-updating needs --api-key: it lets clients make the server read folders")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser")
    engine = AsyncLLMEngine.from_config(config)
    names = args.served_model_name or [engine.engine.model_name]
    lora_modules = LoRAModules()
    for name, path, base in args.lora_modules or ():
        lora = lora_modules.new(name, path)
        try:
            if name in names:
                raise ValueError(f"--lora-modules: {name!r} is the base model's name")
            if base is not None and base not in names:
                raise ValueError(
                    f"--lora-modules: {name!r} names base_model_name {base!r}, and this server serves {names[0]!r}"
                )
            engine.engine.check_lora(lora)
            lora_modules.add(lora)
        except ValueError:
            engine.shutdown()
            raise
    settings = ServerSettings(
        names,
        args.max_waiting_requests,
        args.request_timeout,
        chat_template,
        media,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        reasoning_parser=args.reasoning_parser,
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template_timeout=args.chat_template_timeout,
        max_request_body_bytes=args.max_request_body_bytes,
        max_prompts_per_request=args.max_prompts_per_request,
        metrics_prefix=args.metrics_prefix,
        lora_modules=lora_modules,
    )
    app = build_app(
        engine,
        settings,
        args.api_key,
        args.allowed_origins,
        args.enable_log_requests,
        args.allow_runtime_lora_updating,
        url=page_url(args.host, listen_socket.getsockname()[1]),
    )
    server_config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=5
    )
    return engine, DrainingServer(server_config, app.state.server, args.drain_timeout), listen_socket


def main() -> None:
    run_server(make_parser().parse_args())


if __name__ == "__main__":
    main()

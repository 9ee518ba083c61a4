"""The OpenAI-compatible server: `heteroserve serve` or `python -m heteroserve.entrypoints.openai.api_server`."""

from __future__ import annotations

import argparse
import asyncio
import logging
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
from heteroserve.entrypoints.openai.draining_server import DrainingServer
from heteroserve.entrypoints.openai.errors import APIError
from heteroserve.entrypoints.openai.gate import Gate, ServerState, unless_disconnected
from heteroserve.entrypoints.openai.listen_address import bind_listen_socket, is_loopback, page_url
from heteroserve.entrypoints.openai.lora_modules import LoRAModules
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
from heteroserve.entrypoints.openai.server_args import ServerArgs, make_parser
from heteroserve.entrypoints.openai.serving import Admission, ServerSettings, check_fields
from heteroserve.entrypoints.openai.serving_chat import ServingChat
from heteroserve.entrypoints.openai.serving_completion import ServingCompletion
from heteroserve.entrypoints.openai.serving_pooling import require_task
from heteroserve.lora.request import LoRARequest
from heteroserve.metrics.prometheus import ServerMetrics
from heteroserve.pooling_params import PoolingParams
from heteroserve.sampling_params import SamplingParams

logger = logging.getLogger("heteroserve.server")
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
        task = engine.model.task
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
            "root": (settings.model_root or engine.model.model_name) if lora is None else lora.lora_path,
            "parent": None if lora is None else settings.served_model_names[0],
            "max_model_len": engine.model.max_model_len,
            "task": engine.model.task,  # generate, embed or score: which routes serve it
            # the chat page's Image button
            "capabilities": {"vision": engine.processor.image_processor is not None},
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
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.model.max_model_len}

    @app.post("/detokenize", responses=_API_ERRORS)
    async def detokenize(body: DetokenizeRequest):
        completions.check_model(body.model)
        check_fields(body)
        vocab = engine.model.vocab_size
        if chats.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": await asyncio.to_thread(chats.tokenizer.decode, body.tokens)}


def served_name(model: str) -> str:
    """The name a model is served under by default: a local folder's or file's base name (its path is the card's
    root), a Hugging Face id or the embedded model's name as it is."""
    path = Path(model).expanduser()
    if not path.exists():
        return model
    return path.stem if path.is_file() else path.resolve().name


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
    server = ServerArgs.from_cli_args(args)
    engine_args = EngineArgs.from_cli_args(args, args.model or args.model_tag)
    listen_socket = bind_listen_socket(server.host, server.port) if engine_args.node_rank == 0 else None
    if listen_socket is not None and not is_loopback(server.host) and server.api_key is None:
        logger.warning(
            "listening on %s, reachable from other machines, without --api-key: anyone who reaches it can use "
            "the model (pass --api-key KEY, or --host 127.0.0.1 for this machine only)",
            server.host,
        )
    config = engine_args.create_engine_config()
    media = server.media_policy(config.multimodal)
    if config.parallel.node_rank > 0:  # a worker node: no engine, no HTTP; it serves the head's ranks
        from heteroserve.executor.worker_process import run_node

        raise SystemExit(run_node(config))
    server.check(engine_args)
    chat_template = server.chat_template_text()
    engine = AsyncLLMEngine.from_config(config)
    names = server.served_model_name or [served_name(engine.model.model_name)]
    lora_modules = LoRAModules()
    for name, path, base in server.lora_modules or ():
        lora = lora_modules.new(name, path)
        try:
            if name in names:
                raise ValueError(f"--lora-modules: {name!r} is the base model's name")
            if base is not None and base not in names:
                raise ValueError(
                    f"--lora-modules: {name!r} names base_model_name {base!r}, and this server serves {names[0]!r}"
                )
            engine.processor.check_lora(lora)
            lora_modules.add(lora)
        except ValueError:
            engine.shutdown()
            raise
    settings = ServerSettings(
        names,
        server.max_waiting_requests,
        server.request_timeout,
        chat_template,
        media,
        tool_call_parser=server.tool_call_parser if server.enable_auto_tool_choice else None,
        reasoning_parser=engine_args.reasoning_parser,
        trust_request_chat_template=server.trust_request_chat_template,
        chat_template_timeout=server.chat_template_timeout,
        max_request_body_bytes=server.max_request_body_bytes,
        max_prompts_per_request=server.max_prompts_per_request,
        metrics_prefix=server.metrics_prefix,
        lora_modules=lora_modules,
        model_root=engine.model.model_name,
    )
    app = build_app(
        engine,
        settings,
        server.api_key,
        server.allowed_origins,
        server.enable_log_requests,
        server.allow_runtime_lora_updating,
        url=page_url(server.host, listen_socket.getsockname()[1]),
    )
    server_config = uvicorn.Config(
        app, host=server.host, port=server.port, log_level=server.uvicorn_log_level, timeout_graceful_shutdown=5
    )
    return engine, DrainingServer(server_config, app.state.server, server.drain_timeout), listen_socket


def main() -> None:
    run_server(make_parser().parse_args())


if __name__ == "__main__":
    main()

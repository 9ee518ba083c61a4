"""Loading and unloading LoRA adapters at run time, as vLLM's routes do (`POST /v1/load_lora_adapter` with
lora_name and lora_path, `POST /v1/unload_lora_adapter` with lora_name). Off unless the server was started with
--allow-runtime-lora-updating, which needs --api-key: an adapter is code-free but it is read from the server's disk."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from heteroserve.engine.async_engine import AsyncLLMEngine
from heteroserve.entrypoints.openai.errors import APIError
from heteroserve.entrypoints.openai.serving import ServerSettings

MAX_LORA_NAME_CHARS = 256  # a name is a model name in requests and /v1/models
MAX_LORA_PATH_CHARS = 4096  # Linux's PATH_MAX


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=MAX_LORA_PATH_CHARS)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str
    lora_int_id: int | None = None  # vLLM's optional check that the name still means this adapter


def add_lora_routes(
    app: FastAPI, engine: AsyncLLMEngine, settings: ServerSettings, allow_updates: bool, responses: dict
) -> None:
    modules = settings.lora_modules
    responses = {**responses, 200: {"description": "a line saying what was done", "content": {"text/plain": {}}}}

    def require_updates() -> None:
        if not allow_updates:
            raise APIError(
                404,
                "loading and unloading LoRA adapters at run time is off: start the server with --enable-lora "
                "--allow-runtime-lora-updating --api-key KEY",
            )

    @app.post("/v1/load_lora_adapter", responses=responses)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        require_updates()
        name = body.lora_name
        if name in settings.served_model_names:
            raise APIError(400, f"{name!r} is the base model's name; choose another name for the adapter", "lora_name")
        if modules.get(name) is not None:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        lora = modules.new(name, body.lora_path)
        try:
            await asyncio.to_thread(engine.processor.check_lora, lora)  # reads the adapter's config and header
            modules.add(lora)
        except ValueError as exc:
            raise APIError(400, str(exc), "lora_path") from exc
        except OSError as exc:  # a path the system refuses to look up (a name too long, no permission)
            message = f"LoRA adapter {name!r}: lora_path cannot be read: {exc.strerror}"
            raise APIError(400, message, "lora_path") from exc
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses=responses)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        require_updates()
        lora = modules.get(body.lora_name)
        if lora is None:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name")
        if body.lora_int_id is not None and body.lora_int_id != lora.lora_int_id:
            raise APIError(
                400,
                f"lora_int_id {body.lora_int_id} is not the id of '{body.lora_name}' ({lora.lora_int_id})",
                "lora_int_id",
            )
        modules.remove(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

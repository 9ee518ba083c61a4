"""A minimal OpenAI-compatible back end for the gateway tests, run as its own process, that can be told
(POST /control) to answer normally, fail with 500, answer 429 (with `retry_after` as its Retry-After, if set),
stall before answering, or fail its health check.

Streams send `chunks` events `delay` seconds apart. `GET /seen` lists the X-Request-Id and Authorization
headers of the requests it received.

    python -m tests.gateway.stand_in --port PORT --model NAME
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def build_app(models: list[str]) -> FastAPI:
    app = FastAPI()
    control = {"mode": "ok", "chunks": 5, "delay": 0.0, "retry_after": None}
    seen: list[dict[str, str | None]] = []

    @app.post("/control")
    async def set_control(request: Request):
        control.update(await request.json())
        return control

    @app.get("/seen")
    async def get_seen():
        return seen

    @app.get("/health")
    async def health():
        if control["mode"] == "unhealthy":
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "stand-in"} for m in models]}

    @app.post("/v1/{kind:path}")
    async def generate(kind: str, request: Request):
        body = await request.json()
        seen.append({"request_id": request.headers.get("x-request-id"), "auth": request.headers.get("authorization")})
        if control["mode"] == "error":
            error = {"message": "stand-in told to fail", "type": "InternalServerError", "param": None, "code": 500}
            return JSONResponse({"error": error}, status_code=500)
        if control["mode"] == "busy":
            headers = {} if control["retry_after"] is None else {"Retry-After": control["retry_after"]}
            error = {"message": "stand-in told to be busy", "type": "RateLimitError", "param": None, "code": 429}
            return JSONResponse({"error": error}, status_code=429, headers=headers)
        if control["mode"] == "stall":
            await asyncio.sleep(3600)
        chat = kind == "chat/completions"

        def choice(text: str, finish: str | None) -> dict:
            if chat:
                return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        head = {
            "id": "stand-in-1",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": body["model"],
        }
        if not body.get("stream"):
            text = "stand-in " * control["chunks"]
            answer = {"index": 0, "finish_reason": "length"}
            answer.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            head["object"] = "chat.completion" if chat else "text_completion"
            return {**head, "choices": [answer], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}

        async def events():
            for i in range(control["chunks"]):
                last = i == control["chunks"] - 1
                yield f"data: {json.dumps({**head, 'choices': [choice('x', 'length' if last else None)]})}\n\n"
                await asyncio.sleep(control["delay"])
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", action="append", required=True)
    args = parser.parse_args()
    uvicorn.run(build_app(args.model), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

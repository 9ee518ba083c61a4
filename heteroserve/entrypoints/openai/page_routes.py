"""The chat page's routes, the same in the server and the gateway: / and its assets under /static/."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from heteroserve import web
from heteroserve.entrypoints.openai.errors import APIError


def add_chat_page_routes(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def chat_page():
        return HTMLResponse(web.chat_page())

    @app.get("/static/{path:path}", include_in_schema=False)
    async def chat_page_asset(path: str):
        found = web.asset(path)
        if found is None:
            raise APIError(404, f"there is no page asset {path}")
        content, media_type, cache = found
        return Response(content, media_type=media_type, headers={"Cache-Control": cache})

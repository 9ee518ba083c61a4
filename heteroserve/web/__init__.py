"""The browser chat page, served at / by the server and the gateway; every asset is in this folder (no CDN):
index.html, app.js and its modules, app.css, favicon.svg, and vendor/ (pinned libraries rebuilt by
scripts/build-web-assets.sh)."""

from importlib.resources import files

_MEDIA_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",  # PDF.js's module and worker (vendor/pdfjs/)
    ".css": "text/css; charset=utf-8",
    ".woff2": "font/woff2",
    ".svg": "image/svg+xml",
    ".txt": "text/plain; charset=utf-8",
}


def chat_page() -> str:
    return files(__name__).joinpath("index.html").read_text(encoding="utf-8")


def asset(path: str) -> tuple[bytes, str, str] | None:
    """The bytes, media type and Cache-Control of /static/<path>, or None for anything that is not a page asset."""
    parts = path.split("/")
    suffix = "." + parts[-1].rsplit(".", 1)[-1] if "." in parts[-1] else ""
    if suffix not in _MEDIA_TYPES or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
        return None
    file = files(__name__).joinpath(*parts)
    if not file.is_file():
        return None
    # vendor/ changes only with a new heteroserve release; the page's own files are revalidated on every load.
    cache = "public, max-age=86400" if parts[0] == "vendor" else "no-cache"
    return file.read_bytes(), _MEDIA_TYPES[suffix], cache

"""The page's files: every asset index.html and KaTeX's stylesheet name is in the package and served under
/static/, nothing else is, and the model card tells the page whether the model takes images."""

from __future__ import annotations

import re
from importlib.resources import files

import httpx

from heteroserve import web


def test_every_referenced_asset_is_in_the_package():
    page = web.chat_page()
    referenced = re.findall(r'(?:src|href)="/static/([^"]+)"', page)
    assert set(referenced) == {"favicon.svg", "vendor/katex.min.css", "app.css", "vendor/vendor.min.js", "app.js"}
    assert "http://" not in page and "https://" not in page  # no CDN
    fonts = re.findall(r"url\(fonts/([^)]+)\)", web.asset("vendor/katex.min.css")[0].decode())
    assert fonts and all(f.endswith(".woff2") for f in fonts)
    modules = re.findall(r'from "\./([^"]+)"', web.asset("app.js")[0].decode())
    assert set(modules) == {"markdown.js", "conversations.js", "storage.js", "attachments.js"}
    lazy = re.findall(r'import\("\./([^"]+)"\)', web.asset("attachments.js")[0].decode())  # PDF.js, on a PDF
    assert lazy == ["vendor/pdfjs/pdf.min.mjs"]
    lazy.append("vendor/pdfjs/pdf.worker.min.mjs")
    for path in referenced + modules + lazy + [f"vendor/fonts/{f}" for f in fonts]:
        assert web.asset(path) is not None, path
    licences = files(web).joinpath("vendor", "licenses")
    expected = {"markdown-it.txt", "dompurify.txt", "highlight.js.txt", "katex.txt", "pdfjs-dist.txt"}
    assert expected <= {f.name for f in licences.iterdir()}


def test_only_page_assets_are_served():
    content, media_type, cache = web.asset("vendor/fonts/KaTeX_Main-Regular.woff2")
    assert media_type == "font/woff2" and cache.startswith("public") and content[:4] == b"wOF2"
    assert web.asset("app.js")[2] == "no-cache"
    for path in ["__init__.py", "../__init__.py", "vendor/../app.js", "/etc/passwd", ".hidden.js", "", "vendor"]:
        assert web.asset(path) is None, path


def test_the_server_serves_the_assets_and_says_the_model_takes_no_images(server):
    with httpx.Client(base_url=server.base_url) as client:
        script = client.get("/static/vendor/vendor.min.js")
        assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
        assert client.get("/static/__init__.py").status_code == 404
        assert client.get("/static/vendor/missing.js").status_code == 404
        assert client.get("/v1/models").json()["data"][0]["capabilities"] == {"vision": False}

"""The browser chat page, served at / by the server and the gateway; all assets are in this folder."""

from importlib.resources import files


def chat_page() -> str:
    return files(__name__).joinpath("index.html").read_text(encoding="utf-8")

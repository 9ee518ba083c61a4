"""`heteroserve chat` as a real process against the session's server: streaming, commands, Ctrl-C, errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from heteroserve.entrypoints.chat_client import AnswerPrinter
from tests.entrypoints.server_process import free_port

PROMPT = "\nuser> "
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # the model's own default


class ChatProcess:
    """`heteroserve chat --no-color ARGS` with piped stdin and stdout (stderr merged), its output read as it
    arrives and kept with the time each piece came."""

    def __init__(self, *args: str) -> None:
        command = [sys.executable, "-m", "heteroserve.entrypoints.cli", "chat", "--no-color", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # Ctrl-C as at a terminal even where the tests run in the background (a shell without job control starts
        # them ignoring SIGINT, and the child would inherit that).
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.chunks: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while data := os.read(self.process.stdout.fileno(), 65536):
            self.chunks.append((time.monotonic(), data.decode(errors="replace")))

    def output(self) -> str:
        return "".join(text for _, text in self.chunks)

    def wait_for(self, text: str, start: int = 0, timeout: float = 60) -> int:
        """Waits until `text` appears at or after position `start`; the position after it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.output().find(text, start)
            if found >= 0:
                return found + len(text)
            if self.process.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"{text!r} did not appear; output so far:\n{self.output()}")

    def send(self, line: str) -> int:
        """Writes a line; where the output stood when it was sent."""
        position = len(self.output())
        self.process.stdin.write((line + "\n").encode())
        self.process.stdin.flush()
        return position

    def ask(self, line: str) -> tuple[str, int]:
        """Sends a line and waits for the next prompt: the output in between and the chunks it came in."""
        start, first_chunk = self.send(line), len(self.chunks)
        end = self.wait_for(PROMPT, start)
        return self.output()[start : end - len(PROMPT)], len(self.chunks) - first_chunk

    def finish(self, timeout: float = 30) -> int:
        self.process.stdin.close()
        return self.process.wait(timeout)


def test_streams_answers_keeps_history_and_saves(server, tmp_path):
    chat = ChatProcess("--url", server.base_url, "--temperature", "0", "--max-tokens", "24", "--system-prompt", SYSTEM)
    try:
        chat.wait_for("user> ")
        too_long, _ = chat.ask("word " * 3000)  # past --max-model-len 512: the server's 400, the chat goes on
        assert "error: HTTP 400" in too_long
        answer, chunks = chat.ask("What is the capital of France?")
        assert "Paris" in answer
        streamed = [t for t, text in chat.chunks[-chunks:] if text.strip()]
        assert len(streamed) >= 3 and streamed[-1] - streamed[0] > 0.02, "the answer came in one piece"
        saved = tmp_path / "chat.json"
        chat.ask(f"/save {saved}")
        body = json.loads(saved.read_text())
        assert body["model"] and [m["role"] for m in body["messages"]] == ["system", "user", "assistant"]
        assert body["messages"][1]["content"] == "What is the capital of France?"
        assert "Paris" in body["messages"][2]["content"]
        assert "(conversation cleared)" in chat.ask("/clear")[0]
        chat.send('"""')
        chat.send("Repeat: one")
        chat.ask('"""')
        chat.ask(f"/save {saved}")
        messages = json.loads(saved.read_text())["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant"]
        assert messages[1]["content"] == "Repeat: one"
        assert chat.finish() == 0
    finally:
        chat.process.kill()


def test_ctrl_c_stops_the_answer_not_the_program(server, tmp_path):
    aborted_before = server.metric("heteroserve:request_success_total", finished_reason="abort")
    chat = ChatProcess("--url", server.base_url, "--temperature", "0", "--max-tokens", "200")
    try:
        start = chat.wait_for("user> ")
        chat.send("Write a long story about a dragon who learns to cook.")
        chat.wait_for("Write a long story about a dragon who learns to cook.\n", start)
        first = len(chat.chunks)
        deadline = time.monotonic() + 30
        while len(chat.chunks) < first + 3 and time.monotonic() < deadline:  # a few pieces of the answer
            time.sleep(0.02)
        chat.process.send_signal(signal.SIGINT)
        chat.wait_for("[interrupted]", start)
        chat.wait_for(PROMPT, start)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and server.metric("heteroserve:num_requests_running"):
            time.sleep(0.1)
        assert server.metric("heteroserve:num_requests_running") == 0
        assert server.metric("heteroserve:request_success_total", finished_reason="abort") == aborted_before + 1
        answer, _ = chat.ask("What is the capital of France? Answer in one word.")
        assert "Paris" in answer
        saved = tmp_path / "chat.json"
        chat.ask(f"/save {saved}")
        messages = json.loads(saved.read_text())["messages"]
        assert messages[1]["interrupted"] is True and messages[1]["content"]
        assert "interrupted" not in messages[3]
        position = len(chat.output())
        chat.process.send_signal(signal.SIGINT)  # at the prompt: the line is discarded
        chat.wait_for("(Ctrl-C again to exit)", position)
        chat.process.send_signal(signal.SIGINT)  # twice in a row: exit
        assert chat.process.wait(15) == 0
    finally:
        chat.process.kill()


def test_unreachable_server_names_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    result = subprocess.run(
        [sys.executable, "-m", "heteroserve.entrypoints.cli", "chat", "--url", url, "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert url in result.stderr and "cannot reach" in result.stderr


def test_prompt_flag_asks_and_exits(server):
    """--prompt asks without reading stdin; a URL ending in /v1 (as OpenAI clients take it) works too."""
    chat = ChatProcess("--url", server.base_url + "/v1", "--max-tokens", "2", "--prompt", "Hi")
    assert chat.process.wait(60) == 0
    assert chat.output().startswith("user> Hi\n"), chat.output()


def test_reasoning_and_tool_calls_are_shown_and_kept(capsys):
    printer = AnswerPrinter(color=False)
    deltas = [
        {"role": "assistant", "content": ""},
        {"reasoning_content": "The user wants "},
        {"reasoning_content": "the weather."},
        {"content": "Checking."},
        {"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
    ]
    for delta in deltas:
        printer.feed(delta)
    printer.finish()
    assert capsys.readouterr().out == (
        'thinking: The user wants the weather.\nChecking.\n[tool call] get_weather({"city": "Paris"})\n'
    )
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert printer.message() == {"role": "assistant", "content": "Checking.", "tool_calls": [call]}

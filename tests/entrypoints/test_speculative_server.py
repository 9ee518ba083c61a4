"""A server started with --speculative-config: the official client streams the same greedy text as the plain
session server, several tokens to a chunk where drafts were confirmed, and /metrics counts the drafts."""

from __future__ import annotations

import json

import openai
import pytest

from tests.engine.test_speculative import ECHOING
from tests.entrypoints.server_process import ServerProcess

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4})


@pytest.fixture(scope="module")
def speculative_server():
    process = ServerProcess(
        "--max-model-len", "512", "--kv-cache-memory-bytes", str(128 * 1024**2), "--quantization", "none",
        "--speculative-config", NGRAM,
    )  # fmt: skip
    yield process
    process.stop()


def _stream(base_url: str) -> tuple[list[str], int]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    stream = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=ECHOING,
        max_tokens=48,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            pieces.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return pieces, usage


def test_streams_the_plain_servers_text_in_fewer_chunks(speculative_server, server):
    ours, our_tokens = _stream(speculative_server.base_url)
    theirs, their_tokens = _stream(server.base_url)
    assert "".join(ours) == "".join(theirs)
    assert our_tokens == their_tokens == 48
    assert len(ours) < len(theirs)  # confirmed drafts arrive together
    accepted = speculative_server.metric("heteroserve:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= speculative_server.metric("heteroserve:spec_decode_num_draft_tokens_total")
    assert len(ours) <= 48 - accepted + 1
    # A draft is kept only after every draft before it: the counts by position add up and never grow.
    per_position = [
        speculative_server.metric("heteroserve:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        for i in range(4)
    ]
    assert sum(per_position) == accepted
    assert per_position == sorted(per_position, reverse=True)
    assert per_position[0] <= speculative_server.metric("heteroserve:spec_decode_num_drafts_total")


def test_a_bad_speculative_config_stops_the_command():
    with pytest.raises(RuntimeError, match="server exited"):
        ServerProcess("--speculative-config", '{"method": "eagle"}', startup_timeout=60)

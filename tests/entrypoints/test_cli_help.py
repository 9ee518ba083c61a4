"""Every `heteroserve` command's --help says each option's default once, and nothing for options without one."""

from __future__ import annotations

import re

import pytest

from heteroserve.entrypoints.cli import main

BENCH = ["vision", "embed", "quality", "threads", "soak", "throughput", "latency", "serve"]
COMMANDS = [["serve"], ["chat"], ["gateway"], ["env"], ["build-kernels"], ["export", "onnx"], ["bench"]] + [
    ["bench", name] for name in BENCH
]


def help_text(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--help"])
    assert stopped.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines: one line of words


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_defaults_are_said_once_and_only_when_there_is_one(capsys, argv):
    text = help_text(capsys, argv)
    assert not re.search(r"\(default: (None|False|\[\])\)", text), text
    assert not re.search(r"default[^()]*\) \(default:", text), text


def test_the_servers_address_shows_its_defaults(capsys):
    text = help_text(capsys, ["serve"])
    assert re.search(r"--host HOST [^-]*\(default: 0\.0\.0\.0\)", text), text
    assert re.search(r"--port PORT [^-]*\(default: 8000\)", text), text


def test_every_bench_command_is_described(capsys):
    text = help_text(capsys, ["bench"])
    listed = text.split("positional arguments:")[1].split("options:")[0].split("}", 1)[1]  # after {a,b,...}
    for name in BENCH:
        described = re.search(rf"(^| ){name} (\S+)", listed)
        assert described and described.group(2) not in BENCH, f"bench {name} has no description in: {listed}"

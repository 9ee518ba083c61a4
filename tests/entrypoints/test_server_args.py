"""ServerArgs lists every server setting once: its flags come from it, and each setting's check sits beside it."""

from __future__ import annotations

import dataclasses

import pytest

from heteroserve.engine.engine_args import EngineArgs, cli_flag
from heteroserve.entrypoints.openai.server_args import ServerArgs, make_parser

SETTINGS = dataclasses.fields(ServerArgs)


def test_every_setting_is_a_flag_with_the_fields_default():
    parser = make_parser()
    flags = {option for action in parser._actions for option in action.option_strings}
    for setting in SETTINGS:
        assert cli_flag(setting.name) in flags, setting.name
    assert ServerArgs.from_cli_args(parser.parse_args([])) == ServerArgs()


def test_flags_parse_into_the_fields():
    args = make_parser().parse_args(
        [
            "--port",
            "9000",
            "--served-model-name",
            "a",
            "b",
            "--allowed-origins",
            "--lora-modules",
            "x=/adapters/x",
            "--request-timeout",
            "2.5",
            "--enable-log-requests",
            "--allowed-media-domains",
            "images.example",
        ]
    )
    server = ServerArgs.from_cli_args(args)
    assert server.port == 9000 and server.served_model_name == ["a", "b"] and server.allowed_origins == []
    assert server.lora_modules == [("x", "/adapters/x", None)] and server.request_timeout == 2.5
    assert server.enable_log_requests and server.allowed_media_domains == ["images.example"]
    assert not server.trust_request_chat_template


@pytest.mark.parametrize(
    ("server", "engine", "message"),
    [
        (ServerArgs(request_timeout=0), EngineArgs(), "--request-timeout must be positive"),
        (ServerArgs(chat_template_timeout=-1), EngineArgs(), "--chat-template-timeout must be positive"),
        (ServerArgs(max_request_body_bytes=0), EngineArgs(), "--max-request-body-bytes must be positive"),
        (ServerArgs(max_prompts_per_request=0), EngineArgs(), "--max-prompts-per-request must be positive"),
        (ServerArgs(enable_auto_tool_choice=True), EngineArgs(), "--enable-auto-tool-choice needs --tool-call-parser"),
        (ServerArgs(lora_modules=[("x", "/x", None)]), EngineArgs(), "--lora-modules needs --enable-lora"),
        (
            ServerArgs(allow_runtime_lora_updating=True, api_key="k"),
            EngineArgs(),
            "--allow-runtime-lora-updating needs --enable-lora",
        ),
        (
            ServerArgs(allow_runtime_lora_updating=True),
            EngineArgs(enable_lora=True),
            "--allow-runtime-lora-updating needs --api-key: it lets clients make the server read folders",
        ),
    ],
)
def test_a_setting_that_fails_its_check_is_named(server, engine, message):
    with pytest.raises(ValueError) as stopped:
        server.check(engine)
    assert str(stopped.value) == message


def test_settings_that_pass_their_checks():
    ServerArgs().check(EngineArgs())
    ServerArgs(
        request_timeout=1,
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        lora_modules=[("x", "/x", None)],
        allow_runtime_lora_updating=True,
        api_key="k",
    ).check(EngineArgs(enable_lora=True))


def test_chat_template_is_a_file_or_inline(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{{ messages }}")
    assert ServerArgs(chat_template=str(path)).chat_template_text() == "{{ messages }}"
    assert ServerArgs(chat_template="{{ inline }}").chat_template_text() == "{{ inline }}"
    assert ServerArgs().chat_template_text() is None


def test_media_domains_imply_remote_media():
    from heteroserve.config import MultimodalConfig

    policy = ServerArgs(allowed_media_domains=["images.example"]).media_policy(MultimodalConfig())
    assert policy.allow_remote and policy.allowed_domains == frozenset({"images.example"})
    assert not ServerArgs().media_policy(MultimodalConfig()).allow_remote

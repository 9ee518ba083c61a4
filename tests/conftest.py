"""Session-wide fixtures: the default model loaded once, and its transformers reference."""

from __future__ import annotations

import os
from pathlib import Path

# Tests share 2 cores with the servers they start: OpenMP workers must sleep, not spin, when idle.
# (Read when libgomp loads, so this comes before torch is imported.)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

from tests.reference import GreedyComparison, HFReference  # noqa: E402

# Property and fuzz tests draw the same examples on every run, so CI is reproducible; explore new ones
# with HYPOTHESIS_PROFILE=explore.
settings.register_profile("deterministic", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

_comparisons = GreedyComparison()


@pytest.fixture(scope="session")
def default_model_path():
    from heteroserve.model.loader.source import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def default_tokenizer(default_model_path):
    """Built by transformers from the GGUF metadata, independently of heteroserve's loader."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path.parent, gguf_file=default_model_path.name)


@pytest.fixture(scope="session")
def hf_default(default_model_path, default_tokenizer) -> HFReference:
    """transformers' own GGUF loader and generate(): the independent reference for the default model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        default_model_path.parent, gguf_file=default_model_path.name, dtype=torch.float32
    )
    return HFReference(model.eval(), default_tokenizer)


@pytest.fixture(scope="session")
def default_llm():
    """The default model dequantised to float32 (as the transformers reference runs it), shared by the session."""
    from heteroserve import LLM

    return LLM(max_model_len=512, kv_cache_memory_bytes=128 * 1024**2, quantization="none")


@pytest.fixture(scope="session")
def greedy_comparison() -> GreedyComparison:
    return _comparisons


SIMULATED_DEVICE_TESTS = "tests/platforms/test_simulated_device.py"


def pytest_terminal_summary(terminalreporter):
    if _comparisons.sequences:
        terminalreporter.write_line(_comparisons.summary())
    reports = [
        r
        for outcome in terminalreporter.stats.values()
        for r in outcome
        if getattr(r, "nodeid", "").startswith(SIMULATED_DEVICE_TESTS) and hasattr(r, "duration")
    ]
    if reports:
        tests = len({r.nodeid for r in reports})
        seconds = sum(r.duration for r in reports)
        terminalreporter.write_line(f"simulated-device suite: {tests} tests in {seconds:.0f} s")


@pytest.fixture(scope="session")
def server():
    """One real server on the default model for the whole session."""
    from tests.entrypoints.server_process import ServerProcess

    process = ServerProcess(
        "--max-model-len", "512", "--kv-cache-memory-bytes", str(128 * 1024**2), "--quantization", "none"
    )
    yield process
    process.stop()


EMBEDDER = "tiny-embedder"  # the served name of embedding_server's model


@pytest.fixture(scope="session")
def served_embedder(tmp_path_factory):
    """The tiny BERT embedder of tests/pooling (mean pooling, normalised, Matryoshka sizes 16, 32, 64)."""
    from tests.pooling.tiny_pooling_models import build_bert_embedder

    return build_bert_embedder(tmp_path_factory.mktemp("served") / "bert_embedder")


@pytest.fixture(scope="session")
def embedding_server(served_embedder):
    """One real server on `served_embedder` for the session (the server's and the gateway's pooling tests)."""
    from tests.entrypoints.server_process import ServerProcess

    process = ServerProcess(
        "--model", str(served_embedder.folder), "--served-model-name", EMBEDDER, env={"HETEROSERVE_NUM_THREADS": "1"}
    )
    yield process
    process.stop()


CHROMIUM = Path("/usr/bin/chromium")
needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="no /usr/bin/chromium (scripts/setup.sh installs it when run as root with apt)"
)


@pytest.fixture(scope="module")
def browser():
    """The system's Chromium driven by playwright, one per test module (the chat page tests)."""
    playwright_api = pytest.importorskip("playwright.sync_api")
    with playwright_api.sync_playwright() as playwright:
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
        flags += ["--disable-component-update", "--disable-sync"]
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=flags)
        yield browser
        browser.close()

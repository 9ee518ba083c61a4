"""schemathesis against the server's own OpenAPI schema: no 5xx, responses conform to the schema.

A server of its own with max_model_len=32 keeps every generated request cheap. (schemathesis' pytest
plugin does not load under pytest 9, so the operations are driven through hypothesis directly.)
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.entrypoints.server_process import ServerProcess

EXAMPLES_PER_OPERATION = 12


@pytest.fixture(scope="module")
def fuzz_server():
    process = ServerProcess(
        "--max-model-len", "32", "--kv-cache-memory-bytes", str(16 * 1024**2), "--max-num-seqs", "8"
    )
    yield process
    process.stop()


def test_api_conforms_and_never_fails(fuzz_server):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/models"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck))
        def check(case) -> None:
            response = case.call(base_url=fuzz_server.base_url, timeout=120)
            assert response.status_code < 500, (
                f"{case.method} {case.path}: {response.status_code} {response.text[:300]}"
            )
            # Schema-valid requests may still be refused (a token id beyond the vocabulary): only 5xx and
            # responses that break the schema are failures.
            case.validate_response(response, excluded_checks=[positive_data_acceptance])

        check()

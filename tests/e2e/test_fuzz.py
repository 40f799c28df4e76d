"""Property-based fuzzing of every route in the OpenAPI schema (schemathesis) against a real
``elbowroom serve``: whatever the body, the server answers in time, never with a 500, and
every error is in OpenAI's shape (Ollama's on Ollama's routes). The number of examples is
bounded so the module takes well under a minute; the server runs with an inference key and
an admin key, so the key checks are exercised too.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from serverproc import ServerFactory, ServerProcess

from elbowroom.server.http.ollama_paths import is_ollama_path

ADMIN = {"Authorization": "Bearer fuzz-admin"}
EXAMPLES = 10  # per operation (13 operations): valid and invalid cases mixed
CALL_TIMEOUT = 60.0  # seconds: a hang fails the test


@pytest.fixture(scope="module")
def fuzz_server(server_factory: ServerFactory) -> ServerProcess:
    # Pinned: a fuzzed keep_alive of 0 would otherwise reload the LLM after every request.
    return server_factory(
        "--ctx",
        "256",
        "--pin",
        "smollm2-135m",
        api_key="fuzz-user",
        env={
            "ELBOWROOM_ADMIN_KEY": "fuzz-admin",
            "ELBOWROOM_MAX_TOKENS_CAP": "1",  # generations stay short
            "ELBOWROOM_MAX_SPEECH_CHARS": "64",
            "ELBOWROOM_MAX_EMBEDDING_INPUTS": "8",
            # /api/pull never reaches the real Hub: a port nothing listens on (a 503)
            "HF_ENDPOINT": "http://127.0.0.1:9",
        },
    )


def fuzz_operation(operation: Any, server: ServerProcess, failures: list[str]) -> int:
    """Send EXAMPLES valid and invalid cases of one operation; record what went wrong."""
    sent = 0
    strategy = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
    )

    @given(case=strategy)
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        phases=[Phase.generate],  # no shrinking: a failure is recorded as found
        suppress_health_check=list(HealthCheck),
        derandomize=True,  # the same examples every run
        database=None,
    )
    def check(case: Any) -> None:
        nonlocal sent
        sent += 1
        where = f"{operation.method.upper()} {operation.path}"
        try:
            response = case.call(base_url=server.url, headers=ADMIN, timeout=CALL_TIMEOUT)
        except Exception as exc:  # a timeout is a hang
            failures.append(f"{where}: {type(exc).__name__}: {exc}")
            return
        # 501 (Ollama's push/blobs), 503 (queue full, pressure, the Hub unreachable) and
        # 507 (cannot fit) are answers; any other 5xx is a bug.
        if response.status_code >= 500 and response.status_code not in (501, 503, 507):
            failures.append(f"{where} -> {response.status_code}: {response.text[:300]}")
        elif response.status_code >= 400 and operation.method.upper() != "HEAD":
            try:
                error = response.json()["error"]
                if is_ollama_path(operation.path):  # Ollama's shape: {"error": "message"}
                    assert isinstance(error, str) and error
                else:
                    assert isinstance(error["message"], str) and error["type"]
            except Exception:
                failures.append(f"{where} -> {response.status_code}: not an error body")

    check()
    return sent


@pytest.mark.slow
def test_no_route_answers_500_or_hangs(fuzz_server: ServerProcess) -> None:
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json", headers=ADMIN)
    failures: list[str] = []
    sent = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        sent[f"{operation.method.upper()} {operation.path}"] = fuzz_operation(
            operation, fuzz_server, failures
        )
    assert len(sent) >= 10, sent  # every route of the schema was reached
    assert all(n > 0 for n in sent.values()), sent
    assert failures == [], "\n".join(failures[:20])
    assert fuzz_server.proc is not None and fuzz_server.proc.poll() is None


@pytest.mark.slow
def test_the_schema_and_metrics_need_the_admin_key(fuzz_server: ServerProcess) -> None:
    for path in ("/openapi.json", "/metrics", "/api/elbowroom/ps"):
        assert httpx.get(fuzz_server.url + path, timeout=30).status_code == 401
        user = {"Authorization": "Bearer fuzz-user"}
        r = httpx.get(fuzz_server.url + path, headers=user, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
        assert httpx.get(fuzz_server.url + path, headers=ADMIN, timeout=30).status_code == 200
    user = {"Authorization": "Bearer fuzz-user"}
    assert httpx.get(fuzz_server.url + "/v1/models", headers=user, timeout=30).status_code == 200

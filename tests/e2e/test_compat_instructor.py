"""instructor 1.17.0 against the real server, the calls its docs show (issue 21's
compatibility suite): ``from_openai`` with its default mode (tools) for a plain and a
nested model, streaming ``Partial`` and ``Iterable``, ``Mode.JSON_SCHEMA`` and the Ollama
page's ``Mode.JSON``.

instructor pins ``jiter<0.15`` and the openai client of the main venv needs 0.19, so it
runs from a venv of its own that scripts/setup.sh makes (scripts/compat-instructor.txt),
as a real subprocess: tests/e2e/instructor_client.py prints one JSON line per call.

SmolLM2-135M says little that is useful: the tests assert the protocol (each call parses
into instructor's own types), not the words.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from serverproc import ServerFactory, ServerProcess

pytestmark = pytest.mark.slow

LLM = "smollm2-135m"
PYTHON = Path(sys.prefix) / "compat-instructor" / "bin" / "python"
CLIENT = Path(__file__).with_name("instructor_client.py")


@pytest.fixture(scope="module")
def results(server_factory: ServerFactory) -> dict[str, dict[str, Any]]:
    if not PYTHON.exists():
        pytest.skip(f"instructor's venv is not installed ({PYTHON}): run scripts/setup.sh")
    server: ServerProcess = server_factory("--preload", LLM)
    done = subprocess.run(
        [str(PYTHON), str(CLIENT), server.url, LLM],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {r["call"]: r for r in lines}


def _ok(results: dict[str, dict[str, Any]], call: str) -> Any:
    out = results[call]
    assert out["ok"], out["error"]
    return out["value"]


def test_instructor_default_mode_plain_and_nested_models(
    results: dict[str, dict[str, Any]],
) -> None:
    city = _ok(results, "plain")
    assert isinstance(city["name"], str) and isinstance(city["population"], int)
    # A model with a list of another model: pydantic's $defs inside the tool's parameters
    # were a 400 ("cannot resolve $ref #/$defs/City") until they were inlined.
    country = _ok(results, "nested")
    assert isinstance(country["name"], str) and isinstance(country["cities"], list)
    assert all(isinstance(c["population"], int) for c in country["cities"])


def test_instructor_streams_partial_and_iterable(results: dict[str, dict[str, Any]]) -> None:
    partial = _ok(results, "partial")
    # SmolLM2's template has no tools: emulated calls arrive whole, at the end, so one
    # step carries the object.
    assert partial["steps"] >= 1 and isinstance(partial["last"]["name"], str)
    cities = _ok(results, "iterable")
    assert cities and all(isinstance(c["population"], int) for c in cities)


def test_instructor_json_schema_mode(results: dict[str, dict[str, Any]]) -> None:
    city = _ok(results, "json_schema")  # response_format json_schema, enforced by grammar
    assert isinstance(city["name"], str) and isinstance(city["population"], int)


def test_instructor_ollama_json_mode(results: dict[str, dict[str, Any]]) -> None:
    """Mode.JSON asks for ``json_object`` and puts the schema in the prompt only: the
    server guarantees a JSON object, whether its fields fit is the model's doing (a 135M
    model often nests them). So: parsed, or the answer was a whole JSON object."""
    out = results["ollama_json"]
    if out["ok"]:
        assert isinstance(out["value"]["answer"], str)
        return
    assert "content" in out, out["error"]  # the server answered; no HTTP error
    assert out["finish_reason"] == "stop"
    assert isinstance(json.loads(out["content"]), dict)

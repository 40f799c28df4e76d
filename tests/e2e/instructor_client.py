"""instructor's documented calls against an elbowroom server, run by
tests/e2e/test_compat_instructor.py in instructor's own venv (scripts/compat-instructor.txt:
instructor 1.17.0 pins ``jiter<0.15``, which the openai client of the main venv cannot
have). Not a test module: it imports instructor, which the main venv does not install.

    <venv>/compat-instructor/bin/python tests/e2e/instructor_client.py URL MODEL

Prints one JSON line per call: ``{"call": ..., "ok": true, "value": ...}`` or ``{"call":
..., "ok": false, "error": ..., "content": <the server's answer, when one came>}``. The
test decides what each must be.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from typing import Any

import instructor
from instructor import Partial
from openai import OpenAI
from pydantic import BaseModel


class City(BaseModel):
    name: str
    population: int


class Country(BaseModel):
    name: str
    cities: list[City]


class Reply(BaseModel):
    answer: str


def main() -> None:
    url, model = sys.argv[1], sys.argv[2]
    base = url + "/v1"
    ask_city = [{"role": "user", "content": "Name a big city and its population."}]
    ask_country = [{"role": "user", "content": "Name a country and one of its cities."}]
    opts: dict[str, Any] = {"model": model, "temperature": 0, "max_retries": 0}

    # The README's first example: from_openai with its default mode (tools).
    client = instructor.from_openai(OpenAI(base_url=base, api_key="unused"))

    def plain() -> Any:
        return client.chat.completions.create(
            response_model=City, messages=ask_city, max_tokens=60, **opts
        ).model_dump()

    def nested() -> Any:
        return client.chat.completions.create(
            response_model=Country, messages=ask_country, max_tokens=100, **opts
        ).model_dump()

    def partial() -> Any:
        # "Streaming Partial Responses": each yield is the object so far.
        steps = list(
            client.chat.completions.create(
                response_model=Partial[City], stream=True, messages=ask_city, max_tokens=60, **opts
            )
        )
        return {"steps": len(steps), "last": steps[-1].model_dump()}

    def iterable() -> Any:
        # "Streaming Iterables": one object per item as each completes.
        return [
            c.model_dump()
            for c in client.chat.completions.create(
                response_model=Iterable[City],
                stream=True,
                messages=[{"role": "user", "content": "Name two big cities and their population."}],
                max_tokens=100,
                **opts,
            )
        ]

    def json_schema() -> Any:
        # Mode.JSON_SCHEMA: the schema as OpenAI's response_format.
        schema_client = instructor.from_openai(
            OpenAI(base_url=base, api_key="unused"), mode=instructor.Mode.JSON_SCHEMA
        )
        return schema_client.chat.completions.create(
            response_model=City, messages=ask_city, max_tokens=60, **opts
        ).model_dump()

    def ollama_json() -> Any:
        # instructor's Ollama page: an OpenAI client on Ollama's /v1 in Mode.JSON
        # (response_format json_object; the schema only in the prompt).
        ollama = instructor.from_openai(
            OpenAI(base_url=base, api_key="ollama"), mode=instructor.Mode.JSON
        )
        reply = ollama.chat.completions.create(
            response_model=Reply,
            messages=[{"role": "user", "content": 'Answer in JSON as {"answer": ...}: hi'}],
            max_tokens=40,
            **opts,
        )
        return reply.model_dump()

    calls: dict[str, Callable[[], Any]] = {
        "plain": plain,
        "nested": nested,
        "partial": partial,
        "iterable": iterable,
        "json_schema": json_schema,
        "ollama_json": ollama_json,
    }
    wanted = sys.argv[3:] or list(calls)
    for name in wanted:
        try:
            out = {"call": name, "ok": True, "value": calls[name]()}
        except Exception as exc:  # reported to the test, which judges it
            out = {"call": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
            completion = getattr(exc, "last_completion", None)
            if completion is not None:
                try:
                    out["content"] = completion.choices[0].message.content
                    out["finish_reason"] = completion.choices[0].finish_reason
                except (AttributeError, IndexError):
                    pass
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

"""docs/api.md names every param of the text routes: a param added to a schema without
saying whether it is supported, ignored or refused fails here."""

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from elbowroom.server.openai.schemas import ChatCompletionRequest, CompletionRequest, StreamOptions

DOC = Path(__file__).resolve().parents[3] / "docs" / "api.md"


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest, StreamOptions])
def test_every_param_is_in_the_api_docs(model: type[BaseModel]) -> None:
    text = DOC.read_text()
    # `param`, or each part of `parent.param` / `messages[].name`
    named = {
        part
        for token in re.findall(r"`([a-z_.\[\]]+)`", text)
        for part in re.split(r"[.\[\]]+", token)
    }
    missing = [n for n, f in model.model_fields.items() if (f.alias or n) not in named]
    assert missing == []

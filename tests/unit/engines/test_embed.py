"""OnnxEmbedEngine on the bundled int8 all-MiniLM-L6-v2."""

from __future__ import annotations

import base64
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from bundled_models import bundled_spec

from elbowroom.engines.embed import MAX_TOKENS, OnnxEmbedEngine, mean_pool, plan_batches
from elbowroom.engines.options import EngineOptions
from elbowroom.engines.requests import EmbedRequest, TextRequest
from elbowroom.errors import BadRequest, EngineError

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def engine() -> Any:
    eng = OnnxEmbedEngine()
    facts = eng.load(bundled_spec("minilm-l6-v2"), EngineOptions())
    assert facts == {"max_tokens": MAX_TOKENS, "dimensions": 384}
    yield eng
    eng.close()


def embed(engine: OnnxEmbedEngine, inputs: list[Any]) -> dict[str, Any]:
    return engine.run("embed", EmbedRequest(inputs=tuple(inputs)), lambda _: None, lambda: False)


@pytest.mark.slow
def test_related_sentences_score_higher_than_unrelated(engine: OnnxEmbedEngine) -> None:
    out = embed(
        engine,
        [
            "A man is eating food.",
            "A man is eating a piece of bread.",
            "The stock market fell sharply today.",
        ],
    )
    vectors = np.array(out["embeddings"])
    assert vectors.shape == (3, 384)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    sims = vectors @ vectors.T
    assert sims[0, 1] > 0.5 > sims[0, 2]
    assert out["prompt_tokens"] > 3 * 4


@pytest.mark.slow
def test_batching_does_not_change_the_vectors(engine: OnnxEmbedEngine) -> None:
    """Padding to a batch's longest input must not leak into the pooled vectors."""
    texts = ["short one", "a considerably longer sentence " * 20, "mid length sentence here"]
    together = np.array(embed(engine, texts)["embeddings"])
    alone = np.array([embed(engine, [t])["embeddings"][0] for t in texts])
    assert np.allclose(together, alone, atol=1e-4)


@pytest.mark.slow
def test_long_input_is_truncated_to_the_model_maximum(engine: OnnxEmbedEngine) -> None:
    out = embed(engine, ["word " * 2000])
    assert out["prompt_tokens"] == MAX_TOKENS


@pytest.mark.slow
def test_base64_of_little_endian_float32_round_trips(engine: OnnxEmbedEngine) -> None:
    vector = embed(engine, ["round trip"])["embeddings"][0]
    encoded = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4").tolist()
    assert decoded == vector  # the engine's floats are float32 values: exact


@pytest.mark.slow
def test_an_untyped_payload_is_refused(engine: OnnxEmbedEngine) -> None:
    # The inputs are checked once, by the routes (check_inputs builds the EmbedRequest).
    with pytest.raises(BadRequest, match="takes the typed EmbedRequest, not a dict"):
        engine.run("embed", {"inputs": ["a"]}, lambda _: None, lambda: False)
    with pytest.raises(BadRequest, match="not a TextRequest"):
        engine.run("embed", TextRequest(kind="chat", max_tokens=1), lambda _: None, lambda: False)


def test_batches_group_similar_lengths_within_the_token_budget() -> None:
    lengths = [256, 8, 9, 256, 10, 250]
    batches = plan_batches(lengths, budget=600, cap=64)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for batch in batches:
        assert len(batch) * max(lengths[i] for i in batch) <= 600
    assert batches[0] == [1, 2, 4]  # the short ones together, first
    assert plan_batches([5] * 10, budget=10_000, cap=4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert plan_batches([]) == []


def test_mean_pool_ignores_padding() -> None:
    hidden = np.array([[[1.0, 0.0], [3.0, 0.0], [100.0, 100.0]]], dtype=np.float32)
    mask = np.array([[1, 1, 0]])
    assert np.allclose(mean_pool(hidden, mask), [[1.0, 0.0]])


def test_missing_tokenizer_is_a_load_error() -> None:
    with pytest.raises(EngineError, match=r"tokenizer\.json"):
        OnnxEmbedEngine().load(replace(bundled_spec("minilm-l6-v2"), options={}), EngineOptions())


@pytest.mark.slow
def test_token_ids_in_the_models_own_tokenizer_embed_like_their_text(
    engine: OnnxEmbedEngine,
) -> None:
    """/v1/embeddings with the model named by its id: token ids are the model's own
    (issue 21), decoded with its tokenizer; an id past its vocabulary is a 400."""
    ids = tuple(engine._tokenizer.encode("the sea is wide", add_special_tokens=False).ids)
    out = engine.run("embed", EmbedRequest(inputs=(ids,)), lambda _: None, lambda: False)
    text = embed(engine, ["the sea is wide"])["embeddings"][0]
    assert out["embeddings"][0] == pytest.approx(text, abs=1e-5)
    with pytest.raises(BadRequest, match="tokenizer has"):
        engine.run("embed", EmbedRequest(inputs=((10**7,),)), lambda _: None, lambda: False)


def test_a_cancelled_batch_stops_between_batches(engine: OnnxEmbedEngine) -> None:
    """The client left (the worker's cancel flag): the next batch does not run."""
    inputs = tuple(f"sentence number {i} " * 60 for i in range(64))  # ~256 tokens each
    checks: list[int] = []

    def cancelled() -> bool:
        checks.append(1)
        return len(checks) > 1  # the client leaves during the first batch

    with pytest.raises(EngineError, match="cancelled"):
        engine.run("embed", EmbedRequest(inputs=inputs), lambda _: None, cancelled)
    assert len(checks) == 2  # one batch ran of the several the inputs need
    assert len(plan_batches([256] * 64)) > 2

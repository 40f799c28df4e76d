"""Text embeddings with onnxruntime (a sentence-transformers model exported to ONNX).

Tokenize (truncating to ``max_tokens``, 256 for MiniLM: the model's max_seq_length), run the
encoder in batches, mean-pool the last hidden state over the attention mask, L2-normalize.
A resident engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from elbowroom.engines.base import Cancelled, Emit
from elbowroom.engines.options import EngineOptions
from elbowroom.engines.requests import EmbedRequest, Payload, expect
from elbowroom.errors import BadRequest, EngineError
from elbowroom.models.spec import ModelSpec

MAX_TOKENS = 256
# Padded tokens per batch. Attention memory grows with batch x length^2; 4096 tokens keeps a
# batch of 16 full-length (256-token) inputs near 50 MB of activations, while short
# sentences still go 64 at a time.
BATCH_TOKENS = 4096
MAX_BATCH = 64


def plan_batches(
    lengths: list[int], budget: int = BATCH_TOKENS, cap: int = MAX_BATCH
) -> list[list[int]]:
    """Group input indexes into batches of similar length whose padded size fits ``budget``.

    Sorting by length first means little padding: short inputs are not padded to a long one.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # sorted ascending, so the batch pads to this input's length
        if current and (len(current) >= cap or (len(current) + 1) * lengths[i] > budget):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Mean over the tokens the mask keeps, then unit length (cosine = dot product)."""
    weights = mask[..., None].astype(np.float32)
    summed = (hidden * weights).sum(axis=1)
    pooled = summed / np.clip(weights.sum(axis=1), 1e-9, None)
    return normalize(pooled)


def normalize(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    out: np.ndarray = (vectors / np.clip(norms, 1e-12, None)).astype(np.float32)
    return out


class OnnxEmbedEngine:
    max_concurrent = 1

    def __init__(self) -> None:
        self._session: Any = None
        self._tokenizer: Any = None
        self._input_names: set[str] = set()
        self._pooled_output = False
        self._pad_id = 0
        self._requests = 0
        self._tokens = 0

    def load(self, spec: ModelSpec, options: EngineOptions) -> dict[str, Any]:
        try:
            import onnxruntime as ort
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise EngineError(
                "onnxruntime/tokenizers are not installed: pip install 'elbowroom[embed]'"
            ) from exc
        tokenizer_path = spec.options.get("tokenizer")
        if not tokenizer_path or not Path(tokenizer_path).is_file():
            raise EngineError(f"the embedding model {spec.id} needs a tokenizer.json file")
        max_tokens = MAX_TOKENS
        threads = options.threads or 2
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_path))
            tokenizer.enable_truncation(max_tokens)
            tokenizer.no_padding()  # we pad per batch, to the batch's longest input
            so = ort.SessionOptions()
            so.intra_op_num_threads = threads
            so.inter_op_num_threads = 1
            # Without the arena, a big batch's buffers go back to the OS after the batch
            # instead of staying reserved for the runner's lifetime.
            so.enable_cpu_mem_arena = False
            # Constant folding turns an int8 model's DequantizeLinear nodes into float32
            # copies of the weights: +100 MB anonymous for the 23 MB MiniLM (measured),
            # for outputs equal to 1e-5 and no speed we could measure on 2 cores.
            session = ort.InferenceSession(
                str(spec.path),
                so,
                providers=["CPUExecutionProvider"],
                disabled_optimizers=["ConstantFolding"],
            )
        except Exception as exc:  # onnxruntime raises its own non-exported exception types
            raise EngineError(f"cannot load the embedding model at {spec.path}: {exc}") from exc
        names = {i.name for i in session.get_inputs()}
        if not {"input_ids", "attention_mask"} <= names:
            raise EngineError(f"{spec.path} lacks input_ids/attention_mask inputs: {names}")
        output_rank = len(session.get_outputs()[0].shape)
        self._session, self._tokenizer, self._input_names = session, tokenizer, names
        self._pooled_output = output_rank == 2  # already a sentence embedding
        self._pad_id = int(tokenizer.token_to_id("[PAD]") or 0)
        return {"max_tokens": max_tokens, "dimensions": int(session.get_outputs()[0].shape[-1])}

    def run(self, op: str, payload: Payload, emit: Emit, cancelled: Cancelled) -> dict[str, Any]:
        if op != "embed":
            raise BadRequest(f"the embedding engine does not serve {op!r}; it serves 'embed'")
        if self._session is None:
            raise EngineError("the embedding engine is not loaded")
        inputs = [
            self._text(item, i) for i, item in enumerate(expect(op, payload, EmbedRequest).inputs)
        ]
        encodings = self._tokenizer.encode_batch(inputs)
        lengths = [len(e.ids) for e in encodings]
        result: list[np.ndarray | None] = [None] * len(inputs)
        for batch in plan_batches(lengths):
            if cancelled():
                raise EngineError("cancelled")
            vectors = self._embed([encodings[i] for i in batch])
            for i, vector in zip(batch, vectors, strict=True):
                result[i] = vector
        tokens = sum(lengths)
        self._requests += 1
        self._tokens += tokens
        return {
            "embeddings": [v.tolist() for v in result if v is not None],
            "prompt_tokens": tokens,
        }

    def _text(self, item: str | tuple[int, ...], index: int) -> str:
        """An input's text: token ids (this model's own) decoded with its tokenizer."""
        if isinstance(item, str):
            return item
        size = int(self._tokenizer.get_vocab_size())
        bad = next((t for t in item if t >= size), None)
        if bad is not None:
            raise BadRequest(
                f"input[{index}] has token id {bad}; this model's tokenizer has {size} "
                "(ids sent to a model by its own name are in its own tokenizer)",
                param="input",
            )
        return str(self._tokenizer.decode(list(item), skip_special_tokens=True))

    def _embed(self, encodings: list[Any]) -> np.ndarray:
        width = max(len(e.ids) for e in encodings)
        ids = np.full((len(encodings), width), self._pad_id, dtype=np.int64)
        mask = np.zeros((len(encodings), width), dtype=np.int64)
        for row, enc in enumerate(encodings):
            ids[row, : len(enc.ids)] = enc.ids
            mask[row, : len(enc.ids)] = 1
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._input_names:
            feeds["token_type_ids"] = np.zeros_like(ids)
        try:
            output = self._session.run(None, feeds)[0]
        except Exception as exc:  # onnxruntime's exception types are not importable
            raise EngineError(f"embedding failed: {exc}") from exc
        return normalize(output) if self._pooled_output else mean_pool(output, mask)

    def stats(self) -> dict[str, Any]:
        return {"requests": self._requests, "tokens": self._tokens}

    def relieve(self, level: int) -> None:
        """Nothing to give back: the model is all this engine holds."""

    def close(self, *, process_exit: bool = False) -> None:
        self._session = None
        self._tokenizer = None

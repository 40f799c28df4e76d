"""``write_gguf``: small but genuine GGUF files for the model-layer tests.

A module of its own, not conftest.py: every conftest.py is called "conftest", so
``from conftest import ...`` finds whichever folder's conftest pytest loaded last.
"""

from __future__ import annotations

from pathlib import Path


def write_gguf(
    path: Path,
    *,
    arch: str = "llama",
    layers: int = 2,
    embd: int = 64,
    heads: int | list[int] = 4,
    kv_heads: int | list[int] | None = 2,
    key_length: int | None = None,
    ctx: int = 1024,
    vocab: list[str] | None = None,
    chat_template: str | None = None,
) -> Path:
    """A small but genuine GGUF file (written with the gguf package's own writer)."""
    import numpy as np
    from gguf import GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(path.stem)
    writer.add_block_count(layers)
    writer.add_embedding_length(embd)
    writer.add_head_count(heads)
    if kv_heads is not None:
        writer.add_head_count_kv(kv_heads)
    if key_length is not None:
        writer.add_key_length(key_length)
        writer.add_value_length(key_length)
    writer.add_context_length(ctx)
    writer.add_file_type(1)
    writer.add_token_list(vocab if vocab is not None else [f"t{i}" for i in range(300)])
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.add_tensor("token_embd.weight", np.zeros((8, embd), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

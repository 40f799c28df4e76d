"""A GGUF header read over HTTP with Range requests: the fit check's input (`elbowroom pull`).

The header (metadata, vocabulary, tensor infos) is at the start of the file; the weights
follow it. Reading it remotely takes 1 MiB, then twice as much each time the header runs
past what was read (only the missing part is asked for), up to ``MAX_HEADER_READ``: gemma3's
262,144-token vocabulary makes a 6.2 MiB header (8 MiB read in 4 requests), SmolLM2's
49,152 tokens 1.7 MiB (2 MiB in 2). The reader counts every byte it got (``bytes_read``), which
`elbowroom pull` reports. A server that ignores Range (200 with the whole file) is read only
as far as needed and the connection closed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elbowroom.models.gguf_meta import (
    Header,
    HeaderShort,
    InvalidModel,
    info_from_header,
    parse_header,
)
from elbowroom.models.spec import GGUFInfo
from elbowroom.units import MiB

FIRST_READ = 1 * MiB
MAX_HEADER_READ = 64 * MiB


@dataclass(slots=True)
class RangeReader:
    """Reads the first bytes of remote files, counting what it got."""

    session: Any  # huggingface_hub.utils.get_session(): an httpx-style client
    headers: Mapping[str, str] = field(default_factory=dict)
    bytes_read: int = 0
    requests: int = 0

    def read(self, url: str, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` (exclusive) of ``url``."""
        want = end - start
        headers = {
            **self.headers,
            "Range": f"bytes={start}-{end - 1}",
            "Accept-Encoding": "identity",
        }
        out = bytearray()
        self.requests += 1
        with self.session.stream(
            "GET", url, headers=headers, follow_redirects=True, timeout=30.0
        ) as r:
            _raise_for_status(r)
            skip = start if r.status_code == 200 else 0  # Range ignored: the whole file
            for chunk in r.iter_bytes():
                self.bytes_read += len(chunk)
                if skip:
                    drop = min(skip, len(chunk))
                    chunk, skip = chunk[drop:], skip - drop
                out += chunk
                if len(out) >= want:
                    break
        return bytes(out[:want])

    def header(self, url: str, size: int, name: str) -> Header:
        """The parsed GGUF header of the ``size``-byte file at ``url``."""
        buf = b""
        want = min(FIRST_READ, size)
        while True:
            if want > len(buf):
                got = self.read(url, len(buf), want)
                if not got:
                    raise InvalidModel(f"{name}: the server sent no bytes of its header")
                buf += got
            try:
                return parse_header(buf, file_size=size)
            except HeaderShort as exc:
                if len(buf) >= size:
                    raise InvalidModel(f"{name} is not a readable GGUF file: {exc}") from exc
                if len(buf) >= MAX_HEADER_READ:
                    raise InvalidModel(
                        f"{name}: its GGUF header is larger than {MAX_HEADER_READ // MiB} MiB"
                    ) from exc
                want = min(size, MAX_HEADER_READ, max(len(buf), FIRST_READ) * 2)
            except ValueError as exc:  # structural problems (gguf_meta._Bad)
                raise InvalidModel(f"{name} is not a readable GGUF file: {exc}") from exc


def _raise_for_status(response: Any) -> None:
    from huggingface_hub import hf_raise_for_status

    if response.status_code >= 400:
        response.read()
    hf_raise_for_status(response)


def merge_shards(headers: list[Header]) -> Header:
    """One header for a split model: the first shard's metadata, every shard's tensors."""
    first = headers[0]
    merged = Header(fields=dict(first.fields), longest=dict(first.longest))
    for h in headers:
        merged.n_params += h.n_params
        merged.tensors.extend(h.tensors)
        for kind, nbytes in h.matmul_bytes.items():
            merged.matmul_bytes[kind] = merged.matmul_bytes.get(kind, 0) + nbytes
    return merged


def remote_info(header: Header, filename: str) -> GGUFInfo:
    """The footprint's numbers from a remote header (no projector: none is on disk yet)."""
    return info_from_header(header, Path(filename), beside=False)

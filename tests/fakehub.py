"""A local stand-in for the Hugging Face Hub: the part of its HTTP API huggingface_hub uses to
list and download a model repository (the real one is unreachable offline).

What huggingface_hub 2.x calls, and what this answers (read from its source:
``hf_api.HfApi.model_info``, ``file_download.get_hf_file_metadata`` / ``http_get``,
``utils._http.hf_raise_for_status``):

- ``GET /api/models/USER/REPO[/revision/REV]?blobs=true``: the model info, ``sha`` (the
  commit) and ``siblings`` with ``size`` and ``lfs: {sha256, size, pointerSize}``;
- ``HEAD|GET /USER/REPO/resolve/REV/PATH``: a 302 to ``/cdn/SHA256`` (relative, so it
  stays on the "Hub" and is followed) for LFS files, with ``X-Repo-Commit``,
  ``X-Linked-Etag``, ``X-Linked-Size`` and ``ETag``; small files are answered in place;
- ``GET /cdn/SHA256`` with ``Range: bytes=A-[B]``: 206 and ``Content-Range``;
- errors as the Hub sends them: 401 + ``X-Error-Code: RepoNotFound`` for an unknown (or
  private) repo, ``GatedRepo`` for a gated one without an accepted token, 404 +
  ``RevisionNotFound`` / ``EntryNotFound``.

Files are served from disk (the bundled GGUFs) or generated on demand (``Generated``: a
header followed by zeros, e.g. a "70 GB" model whose body never exists). Tests can slow a
download down (``rate``), corrupt a byte of what is served (``corrupt``), and read what was
asked and sent (``log``, ``sent``). A threaded server on an ephemeral port.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Blob:
    """One file's bytes: ``read(offset, n)``; ``sha256`` is what the Hub's metadata says."""

    size: int
    read: Callable[[int, int], bytes]
    sha256: str
    lfs: bool = True


def disk_blob(path: Path) -> Blob:
    data_path = Path(path)
    h = hashlib.sha256()
    with data_path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)

    def read(offset: int, n: int) -> bytes:
        with data_path.open("rb") as fh:
            fh.seek(offset)
            return fh.read(n)

    return Blob(data_path.stat().st_size, read, h.hexdigest())


def bytes_blob(data: bytes, lfs: bool = False) -> Blob:
    return Blob(len(data), lambda o, n: data[o : o + n], hashlib.sha256(data).hexdigest(), lfs=lfs)


def generated_blob(head: bytes, size: int) -> Blob:
    """``head`` then zeros up to ``size`` bytes; its sha256 is made up (never downloaded)."""

    def read(offset: int, n: int) -> bytes:
        n = max(0, min(n, size - offset))
        part = head[offset : offset + n]
        return part + bytes(n - len(part))

    fake = hashlib.sha256(head + str(size).encode()).hexdigest()
    return Blob(size, read, fake)


@dataclass
class Repo:
    files: dict[str, Blob]
    gated: bool = False


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    token: str = "hf_test_token"  # the token gated repos accept
    rate: float | None = None  # bytes per second for /cdn bodies (None: as fast as it goes)
    corrupt: set[str] = field(default_factory=set)  # sha256s whose byte 1000 is flipped
    down: bool = False  # the network is down: connections are cut, mid-body ones too
    log: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, Range
    sent: dict[str, int] = field(default_factory=dict)  # body bytes sent, per sha256
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def count(self, sha256: str, n: int) -> None:
        with self._lock:
            self.sent[sha256] = self.sent.get(sha256, 0) + n

    def blob(self, sha256: str) -> Blob | None:
        for repo in self.repos.values():
            for b in repo.files.values():
                if b.sha256 == sha256:
                    return b
        return None


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    # -- routing

    def _cut(self) -> None:
        """What a network that went down looks like: the connection just ends."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def _route(self, head: bool) -> None:
        if self.hub.down:
            return self._cut()
        path = self.path.split("?", 1)[0]
        self.hub.log.append((self.command, path, self.headers.get("Range")))
        m = re.match(r"^/api/models/([^/]+/[^/]+?)(?:/revision/([^/]+))?/?$", path)
        if m:
            return self._info(m[1], m[2], head)
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if m:
            return self._resolve(m[1], m[2], m[3], head)
        m = re.match(r"^/cdn/([0-9a-f]{64})$", path)
        if m:
            return self._cdn(m[1], head)
        self._error(404, "EntryNotFound", f"no route {path}")

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _repo(self, repo_id: str, revision: str | None) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(401, "RepoNotFound", "Repository Not Found")
            return None
        if revision not in (None, "main", COMMIT):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo

    def _authorized(self) -> bool:
        return self.headers.get("Authorization") == f"Bearer {self.hub.token}"

    def _info(self, repo_id: str, revision: str | None, head: bool) -> None:
        repo = self._repo(repo_id, revision)
        if repo is None:
            return
        siblings = []
        for name, b in sorted(repo.files.items()):
            item: dict[str, Any] = {"rfilename": name, "size": b.size, "blobId": b.sha256[:40]}
            if b.lfs:
                item["lfs"] = {"sha256": b.sha256, "size": b.size, "pointerSize": 134}
            siblings.append(item)
        body = json.dumps(
            {
                "_id": "x",
                "id": repo_id,
                "modelId": repo_id,
                "sha": COMMIT,
                "private": False,
                "gated": "manual" if repo.gated else False,
                "disabled": False,
                "tags": ["gguf"],
                "siblings": siblings,
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _resolve(self, repo_id: str, revision: str, name: str, head: bool) -> None:
        repo = self._repo(repo_id, revision)
        if repo is None:
            return
        if repo.gated and not self._authorized():
            self._error(
                401,
                "GatedRepo",
                f"Access to model {repo_id} is restricted and you are not in the authorized list.",
            )
            return
        blob = repo.files.get(name)
        if blob is None:
            self._error(404, "EntryNotFound", f"{name} does not exist")
            return
        common = {
            "X-Repo-Commit": COMMIT,
            "ETag": f'"{blob.sha256[:40]}"',
        }
        if blob.lfs:
            self.send_response(302)
            for k, v in common.items():
                self.send_header(k, v)
            self.send_header("X-Linked-Etag", f'"{blob.sha256}"')
            self.send_header("X-Linked-Size", str(blob.size))
            self.send_header("Location", f"/cdn/{blob.sha256}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._body(blob, head, {**common, "ETag": f'"{blob.sha256}"'})

    def _cdn(self, sha256: str, head: bool) -> None:
        blob = self.hub.blob(sha256)
        if blob is None:
            self._error(404, "EntryNotFound", "no such blob")
            return
        self._body(
            blob,
            head,
            {
                "X-Repo-Commit": COMMIT,
                "X-Linked-Etag": f'"{blob.sha256}"',
                "X-Linked-Size": str(blob.size),
                "ETag": f'"{blob.sha256}"',
            },
        )

    def _body(self, blob: Blob, head: bool, headers: dict[str, str]) -> None:
        start, end = 0, blob.size - 1
        rng = self.headers.get("Range")
        m = re.match(r"^bytes=(\d+)-(\d*)$", rng or "")
        status = 200
        if m:
            start = int(m[1])
            end = min(int(m[2]) if m[2] else blob.size - 1, blob.size - 1)
            if start >= blob.size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{blob.size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{blob.size}")
        self.end_headers()
        if head:
            return
        offset, chunk = start, 64 * 1024
        started = time.monotonic()
        try:
            while offset <= end:
                if self.hub.down:
                    return self._cut()
                n = min(chunk, end - offset + 1)
                data = blob.read(offset, n)
                if blob.sha256 in self.hub.corrupt and offset <= 1000 < offset + n:
                    i = 1000 - offset
                    data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
                self.wfile.write(data)
                self.hub.count(blob.sha256, len(data))
                offset += n
                if self.hub.rate:
                    ahead = (offset - start) / self.hub.rate - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)  # pacing the body, not synchronising a test
        except (BrokenPipeError, ConnectionResetError):
            return


# --- a "70 GB" GGUF: a real header describing tensors whose bytes are never stored ----------


def _s(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def big_gguf_header(total: int = 70 * 10**9, n_layers: int = 80) -> tuple[bytes, int]:
    """(header bytes, file size) of a llama-architecture GGUF whose tensors add up to about
    ``total`` bytes: F16 matrices, one per layer, plus the token embeddings."""
    n_embd, vocab = 8192, 128_256
    kvs = [
        _s("general.architecture") + struct.pack("<I", 8) + _s("llama"),
        _s("general.name") + struct.pack("<I", 8) + _s("Big 70B"),
        _s("general.file_type") + struct.pack("<II", 4, 1),
    ]
    for key, value in (
        ("block_count", n_layers),
        ("embedding_length", n_embd),
        ("attention.head_count", 64),
        ("attention.head_count_kv", 8),
        ("feed_forward_length", 28_672),
        ("context_length", 8192),
        ("vocab_size", vocab),
    ):
        kvs.append(_s(f"llama.{key}") + struct.pack("<II", 4, value))
    embd_bytes = n_embd * vocab * 2
    per_layer = (total - embd_bytes) // n_layers // (n_embd * 2 * 32) * 32
    tensors = [(("token_embd.weight"), [n_embd, vocab])]
    tensors += [(f"blk.{i}.ffn_down.weight", [n_embd, per_layer]) for i in range(n_layers)]
    infos, offset = b"", 0
    for name, dims in tensors:
        infos += _s(name) + struct.pack("<I", len(dims))
        infos += b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", 1, offset)  # F16
        offset += dims[0] * dims[1] * 2
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + infos
    data_start = -(-len(head) // 32) * 32
    head += bytes(data_start - len(head))
    return head, data_start + offset


def split_gguf(n_shards: int = 2, n_layers: int = 2, n_embd: int = 64) -> list[bytes]:
    """A small llama model split in ``n_shards`` valid GGUF files (zeroed F32 weights): the
    first holds the metadata, each holds its layers' tensors (llama.cpp's gguf-split)."""
    shards = []
    per = -(-n_layers // n_shards)
    for k in range(n_shards):
        kvs = [
            _s("split.no") + struct.pack("<IH", 2, k),
            _s("split.count") + struct.pack("<IH", 2, n_shards),
            _s("split.tensors.count") + struct.pack("<Ii", 5, n_layers),
        ]
        if k == 0:
            kvs += [
                _s("general.architecture") + struct.pack("<I", 8) + _s("llama"),
                _s("general.name") + struct.pack("<I", 8) + _s("Tiny split"),
            ]
            for key, value in (
                ("block_count", n_layers),
                ("embedding_length", n_embd),
                ("attention.head_count", 4),
                ("context_length", 512),
                ("vocab_size", 256),
            ):
                kvs.append(_s(f"llama.{key}") + struct.pack("<II", 4, value))
        layers = range(k * per, min(n_layers, (k + 1) * per))
        infos, offset = b"", 0
        for i in layers:
            infos += _s(f"blk.{i}.ffn_down.weight") + struct.pack("<IQQ", 2, n_embd, n_embd)
            infos += struct.pack("<IQ", 0, offset)  # F32
            offset += n_embd * n_embd * 4
        head = b"GGUF" + struct.pack("<IQQ", 3, len(layers), len(kvs)) + b"".join(kvs) + infos
        head += bytes(-(-len(head) // 32) * 32 - len(head))
        shards.append(head + bytes(offset))
    return shards

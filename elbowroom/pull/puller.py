"""Getting models from the Hugging Face Hub: `elbowroom pull`, `elbowroom rm`, /api/pull.

A pull, in order (docs/pull.md):

1. **manifest**: the repository's file list with each file's size and LFS sha256
   (``HfApi.model_info(files_metadata=True)``) at the asked revision, pinned to its commit;
2. **choice**: a GGUF quant by name (``USER/REPO:Q4_K_M``), the largest that fits when
   none is named, or ``--file``; split GGUFs as a whole; a vision model's ``mmproj`` beside
   it; a faster-whisper folder (``model.bin`` + ``config.json``) or an ONNX embedder
   (``tokenizer.json`` + ``[onnx/]model.onnx``) as the files the catalog needs;
3. **fit check** before the first byte of weights: the GGUF header read with HTTP Range
   requests (``remote_gguf``; the bytes read are counted and reported), the footprint
   predicted by elbowroom's own estimate for this machine (``pullfit``): fits / fits at
   --ctx N / never fits here (the 507's numbers), then the disk's free space;
4. **download** into huggingface_hub's cache layout (``HF_HUB_CACHE``, default
   ``~/.cache/huggingface/hub``: ``models--USER--REPO/{blobs,snapshots,refs}``), each file
   as ``blobs/<etag>.incomplete`` first, resumed with a Range request when a pull was
   interrupted, its sha256 checked against the Hub's LFS metadata, then renamed into place;
5. **install**: symlinks in ``<models_dir>/hf.co/USER/REPO/``, where the catalog finds
   them, each made under a hidden name and renamed, the file that makes the model visible
   (first shard, ``model.bin``, ``model.onnx``) last: the catalog never sees half a model.

``HF_TOKEN`` (or huggingface_hub's saved login) opens gated and private repos;
``HF_ENDPOINT`` names a mirror. Errors are ``ElbowroomError``s with their HTTP status, so
the CLI and /api/pull report them alike.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elbowroom.config import Settings
from elbowroom.errors import (
    BadRequest,
    ElbowroomError,
    Forbidden,
    InsufficientMemory,
    Unavailable,
    Unprocessable,
)
from elbowroom.models.catalog import discover, slug
from elbowroom.models.spec import Holding, ModelKind, ModelSpec
from elbowroom.pull.fit import (
    FITS,
    FITS_AT_CTX,
    FitVerdict,
    check_fit,
    machine_limit,
)
from elbowroom.units import MiB
from elbowroom.units import format_size as fs

log = logging.getLogger(__name__)

HUB_FOLDER = "hf.co"  # under the models folder: hf.co/USER/REPO/<files>
DISK_MARGIN = 256 * MiB  # free space a pull leaves on the disk, at least
HUB_TIMEOUT = 30.0  # seconds without an answer from the Hub: unreachable (503)
_SHARD_RE = re.compile(r"^(?P<base>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.I)
_QUANT_RE = re.compile(
    r"(?:^|[-_.])((?:I?Q\d+(?:_[A-Z0-9]+)*)|BF16|F16|F32|FP16|FP32|MXFP4(?:_MOE)?)(?=$|[-_.])",
    re.I,
)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_HF_PREFIXES = ("https://huggingface.co/", "https://hf.co/", "huggingface.co/", "hf.co/")
_PROJECTOR_PREFERENCE = ("F16", "BF16", "Q8_0", "F32")
_EMBED_EXTRAS = (
    "config.json",
    "special_tokens_map.json",
    "tokenizer_config.json",
    "vocab.txt",
)

Progress = Callable[[dict[str, Any]], None]


# --- errors ---------------------------------------------------------------------------


class RepoNotFound(ElbowroomError):
    status = 404
    type = "not_found_error"


class NothingToServe(Unprocessable):
    """The repository exists but has nothing elbowroom serves."""


class UnknownQuant(BadRequest):
    pass


class GatedRepo(Forbidden):
    pass


class HubUnreachable(Unavailable):
    pass


class ChecksumMismatch(Unavailable):
    pass


class InsufficientStorage(ElbowroomError):
    status = 507
    type = "insufficient_storage"


class PullCancelled(ElbowroomError):
    status = 499
    type = "cancelled"


# --- names ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PullName:
    repo_id: str
    quant: str | None = None


def parse_name(text: str) -> PullName:
    """``hf.co/USER/REPO[:QUANT]`` or ``USER/REPO[:QUANT]`` (Ollama's and llama-server's
    names); a ``:latest`` tag (what Ollama clients add) means no quant."""
    name = text.strip()
    for prefix in _HF_PREFIXES:
        if name.lower().startswith(prefix):
            name = name[len(prefix) :]
            break
    repo, _, quant = name.partition(":")
    repo = repo.strip("/")
    if not _NAME_RE.match(repo) or ".." in repo:
        library = " (elbowroom pulls from Hugging Face, not Ollama's library)" * ("/" not in repo)
        raise BadRequest(
            f"{text!r} is not a Hugging Face model name{library}: use hf.co/USER/REPO[:QUANT]"
            " or USER/REPO[:QUANT], e.g. hf.co/bartowski/Qwen_Qwen3-4B-GGUF:Q4_K_M",
            param="model",
            code="invalid_model_name",
        )
    quant = quant.strip()
    if quant.lower() == "latest":
        quant = ""
    return PullName(repo, quant or None)


def quant_of(filename: str) -> str | None:
    """The quant tag in a GGUF file's name (``Q4_K_M``, ``IQ4_XS``, ``F16``...), upper-case."""
    base = Path(filename).name
    shard = _SHARD_RE.match(base)
    stem = shard["base"] if shard else base.removesuffix(".gguf").removesuffix(".GGUF")
    found = _QUANT_RE.findall(stem)
    return found[-1].upper() if found else None


# --- the repository's files -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RemoteFile:
    path: str  # inside the repository
    size: int
    sha256: str | None  # LFS files: the Hub's sha256 of the content


@dataclass(frozen=True, slots=True)
class Choice:
    kind: ModelKind
    files: tuple[RemoteFile, ...]  # installed in this order: the anchor is last
    anchor: str  # the file that makes the model visible to the catalog
    quant: str | None = None
    shards: tuple[RemoteFile, ...] = ()  # a GGUF model's shards (first = anchor)
    projector: RemoteFile | None = None


@dataclass(slots=True)
class PullPlan:
    repo_id: str
    revision: str
    commit: str
    choice: Choice
    dest: Path  # <models_dir>/hf.co/USER/REPO
    why: str  # how the files were chosen, for people
    fit: FitVerdict | None
    header_bytes: int = 0  # bytes the fit check read
    header_requests: int = 0
    forced: bool = False
    to_download: int = 0  # bytes still to come (partial and cached files subtracted)
    disk_free: int = 0

    @property
    def total(self) -> int:
        return sum(f.size for f in self.choice.files)

    def to_dict(self) -> dict[str, Any]:
        return {
            "repo": self.repo_id,
            "revision": self.revision,
            "commit": self.commit,
            "kind": str(self.choice.kind),
            "quant": self.choice.quant,
            "files": [
                {"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.choice.files
            ],
            "size": self.total,
            "to_download": self.to_download,
            "disk_free": self.disk_free,
            "dest": str(self.dest),
            "why": self.why,
            "fit": self.fit.to_dict() if self.fit is not None else None,
            "header_bytes_read": self.header_bytes,
            "header_requests": self.header_requests,
            "forced": self.forced,
        }


@dataclass(slots=True)
class PullResult:
    plan: PullPlan
    model_id: str | None
    path: Path
    downloaded: int  # bytes that came over the network this time
    resumed: int  # bytes of interrupted downloads that were kept
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.plan.to_dict(),
            "model": self.model_id,
            "path": str(self.path),
            "downloaded": self.downloaded,
            "resumed": self.resumed,
            "seconds": round(self.seconds, 3),
        }


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def hub_cache() -> Path:
    """huggingface_hub's cache folder, read from the environment at call time."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(home).expanduser() / "hub"


def hub_token() -> str | None:
    if os.environ.get("HF_TOKEN"):
        return os.environ["HF_TOKEN"]
    from huggingface_hub import get_token

    return get_token()


def _storage(repo_id: str) -> Path:
    return hub_cache() / ("models--" + repo_id.replace("/", "--"))


# --- choosing files -------------------------------------------------------------------


def _is_projector(path: str) -> bool:
    name = Path(path).name.lower()
    return name.startswith("mmproj") and name.endswith(".gguf")


def _groups(ggufs: list[RemoteFile]) -> dict[str, list[RemoteFile]]:
    """Model files by model: a split model's shards together, first shard first."""
    groups: dict[str, list[RemoteFile]] = {}
    for f in sorted(ggufs, key=lambda f: f.path):
        shard = _SHARD_RE.match(f.path)
        key = shard["base"] if shard else f.path
        groups.setdefault(key, []).append(f)
    return groups


def _complete(key: str, files: list[RemoteFile]) -> bool:
    shard = _SHARD_RE.match(files[0].path)
    return shard is None or (int(shard["index"]) == 1 and len(files) == int(shard["count"]))


def _listing(files: Iterable[RemoteFile], limit: int = 30) -> str:
    names = [f.path for f in files]
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more if names else "nothing"


def _projector(files: list[RemoteFile]) -> RemoteFile | None:
    found = sorted((f for f in files if _is_projector(f.path)), key=lambda f: f.path)
    if not found:
        return None
    for want in _PROJECTOR_PREFERENCE:
        for f in found:
            if quant_of(f.path) == want:
                return f
    return min(found, key=lambda f: f.size)


def gguf_candidates(
    repo_id: str, files: list[RemoteFile], quant: str | None, file: str | None
) -> list[tuple[str | None, list[RemoteFile]]]:
    """The GGUF models of ``files`` that the name asks for, largest first:
    [(quant tag, shards)]. Raises UnknownQuant / NothingToServe with what is there."""
    ggufs = [f for f in files if f.path.lower().endswith(".gguf") and not _is_projector(f.path)]
    groups = {k: v for k, v in _groups(ggufs).items() if _complete(k, v)}
    if file is not None:
        for shards in groups.values():
            if file in (shards[0].path, Path(shards[0].path).name) or any(
                file == s.path for s in shards
            ):
                return [(quant_of(shards[0].path), shards)]
        raise NothingToServe(
            f"{repo_id} has no GGUF model file {file!r}; its files: {_listing(files)}",
            param="file",
            code="file_not_found",
        )
    out = [(quant_of(v[0].path), v) for v in groups.values()]
    if quant is not None:
        picked = [c for c in out if (c[0] or "").upper() == quant.upper()]
        if not picked:
            tags = sorted({c[0] or Path(c[1][0].path).name for c in out})
            raise UnknownQuant(
                f"{repo_id} has no {quant} quant; its quants: {', '.join(tags) or 'none'}",
                param="model",
                code="unknown_quant",
                details={"quants": tags},
            )
        out = picked
    return sorted(out, key=lambda c: -sum(f.size for f in c[1]))


def _whisper(files: list[RemoteFile]) -> Choice | None:
    root = {f.path: f for f in files if "/" not in f.path}
    if "model.bin" not in root or "config.json" not in root:
        return None
    keep = [
        f
        for f in root.values()
        if f.path != "model.bin" and f.path not in (".gitattributes", "README.md")
    ]
    return Choice(ModelKind.ASR, (*keep, root["model.bin"]), "model.bin")


def _onnx_embedder(files: list[RemoteFile]) -> Choice | None:
    by_path = {f.path: f for f in files}
    if "tokenizer.json" not in by_path:
        return None
    onnx = by_path.get("onnx/model.onnx") or by_path.get("model.onnx")
    if onnx is None:
        return None
    keep = [by_path["tokenizer.json"], *(by_path[n] for n in _EMBED_EXTRAS if n in by_path)]
    return Choice(ModelKind.EMBEDDING, (*keep, onnx), onnx.path)


# --- the puller -----------------------------------------------------------------------


@dataclass
class Puller:
    """One pull (or plan). ``progress`` gets Ollama-style progress objects; ``cancel``
    stops a download between chunks (the partial file is kept for a resume)."""

    settings: Settings
    progress: Progress | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    token: str | None = None
    endpoint: str = field(default_factory=hub_endpoint)

    def __post_init__(self) -> None:
        if self.token is None:
            self.token = hub_token()

    def emit(self, **event: Any) -> None:
        if self.progress is not None:
            self.progress(event)

    # -- the Hub's answers, as elbowroom's errors

    def _hub_error(self, exc: Exception, repo_id: str, what: str) -> ElbowroomError:
        from huggingface_hub import errors as hub

        url = f"{self.endpoint}/{repo_id}"
        if isinstance(exc, hub.GatedRepoError):
            return GatedRepo(
                f"{repo_id} is a gated repository: accept its terms at {url} and give "
                "elbowroom your token (HF_TOKEN, or `hf auth login`)"
                + (" — the token sent was not granted access" if self.token else ""),
                code="gated_repo",
            )
        if isinstance(exc, hub.RevisionNotFoundError):
            return RepoNotFound(
                f"{what} is not on {self.endpoint}: no such branch, tag or commit",
                param="revision",
                code="revision_not_found",
            )
        if isinstance(exc, hub.RepositoryNotFoundError):
            hint = "" if self.token else " (a private repository needs HF_TOKEN)"
            return RepoNotFound(
                f"no model repository {repo_id} on {self.endpoint}{hint}",
                param="model",
                code="repo_not_found",
            )
        if isinstance(exc, hub.HfHubHTTPError):
            status = getattr(exc.response, "status_code", None)
            if status in (401, 403):
                return GatedRepo(
                    f"{self.endpoint} refused access to {repo_id} ({status}): set HF_TOKEN "
                    "to a token that may read it",
                    code="hub_access_denied",
                )
            return HubUnreachable(
                f"{self.endpoint} answered {status} for {what}: try again later",
                retry_after=10,
                code="hub_error",
            )
        return HubUnreachable(
            f"cannot reach {self.endpoint} for {what}: {type(exc).__name__}: {exc} "
            "(offline? a mirror can be named with HF_ENDPOINT)",
            retry_after=10,
            code="hub_unreachable",
        )

    def _call(self, repo_id: str, what: str, fn: Callable[[], Any]) -> Any:
        from huggingface_hub import errors as hub

        try:
            return fn()
        except ElbowroomError:
            raise
        except (hub.HfHubHTTPError, ConnectionError, TimeoutError, hub.OfflineModeIsEnabled) as exc:
            raise self._hub_error(exc, repo_id, what) from exc
        except OSError as exc:  # this machine's files, not the network
            raise ElbowroomError(
                f"pulling {repo_id}: {what}: {exc.strerror or exc} ({exc.filename or ''})",
                code="pull_io_error",
            ) from exc
        except Exception as exc:
            if _is_transport_error(exc):
                raise self._hub_error(exc, repo_id, what) from exc
            raise

    # -- 1. manifest

    def manifest(self, repo_id: str, revision: str | None) -> tuple[str, list[RemoteFile]]:
        from huggingface_hub import HfApi

        api = HfApi(endpoint=self.endpoint, token=self.token or False)
        info = self._call(
            repo_id,
            f"revision {revision or 'main'!r} of {repo_id}",
            lambda: api.model_info(
                repo_id, revision=revision, files_metadata=True, timeout=HUB_TIMEOUT
            ),
        )
        files = []
        for s in info.siblings or ():
            lfs = s.lfs
            size = s.size if s.size is not None else (lfs.size if lfs is not None else 0)
            files.append(RemoteFile(s.rfilename, int(size or 0), lfs.sha256 if lfs else None))
        return str(info.sha or revision or "main"), files

    # -- 2 and 3. choice and fit check

    def plan(
        self,
        name: str | PullName,
        *,
        file: str | None = None,
        revision: str | None = None,
        force: bool = False,
    ) -> PullPlan:
        want = parse_name(name) if isinstance(name, str) else name
        repo_id = want.repo_id
        self.emit(status="pulling manifest")
        commit, files = self.manifest(repo_id, revision)
        dest = self.settings.models_path / HUB_FOLDER / Path(*repo_id.split("/"))
        from huggingface_hub import get_session
        from huggingface_hub.utils._headers import build_hf_headers

        from elbowroom.pull.remote_gguf import RangeReader

        reader = RangeReader(get_session(), build_hf_headers(token=self.token or False))
        candidates = (
            gguf_candidates(repo_id, files, want.quant, file)
            if any(f.path.lower().endswith(".gguf") for f in files) or file or want.quant
            else []
        )
        if candidates:
            try:
                plan = self._plan_gguf(
                    repo_id, commit, files, candidates, dest, reader, want, force
                )
            except InsufficientMemory as err:  # what the refusal cost to find out
                err.details["header_bytes_read"] = reader.bytes_read
                err.details["header_requests"] = reader.requests
                raise
        else:
            choice = _whisper(files) or _onnx_embedder(files)
            if choice is None:
                raise NothingToServe(
                    f"{repo_id} has nothing elbowroom can serve (no GGUF model, no "
                    "faster-whisper folder, no ONNX embedder); its files: "
                    f"{_listing(files)}",
                    param="model",
                    code="no_model_files",
                    details={"files": [f.path for f in files]},
                )
            spec = _resident_spec(choice, dest)
            fit = check_fit(spec, self.settings)
            plan = PullPlan(repo_id, revision or "main", commit, choice, dest, "", fit)
            plan.why = f"a {choice.kind} model ({len(choice.files)} files)"
            if not fit.ok and not force:
                assert fit.error is not None
                raise fit.error
        plan.revision = revision or "main"
        plan.header_bytes = reader.bytes_read
        plan.header_requests = reader.requests
        plan.forced = force and plan.fit is not None and not plan.fit.ok
        self._check_disk(plan)
        if plan.fit is not None:
            self.emit(
                status=f"fit check: {plan.fit.message}",
                fit=plan.fit.verdict,
                header_bytes_read=plan.header_bytes,
                quant=plan.choice.quant,
            )
        return plan

    def _plan_gguf(
        self,
        repo_id: str,
        commit: str,
        files: list[RemoteFile],
        candidates: list[tuple[str | None, list[RemoteFile]]],
        dest: Path,
        reader: Any,
        want: PullName,
        force: bool,
    ) -> PullPlan:
        from huggingface_hub import hf_hub_url

        projector = _projector(files)
        proj_info = None
        if projector is not None:
            url = hf_hub_url(repo_id, projector.path, revision=commit, endpoint=self.endpoint)
            proj_info = self._call(
                repo_id,
                projector.path,
                lambda: _projector_info(reader, url, projector, dest),
            )
        named = want.quant is not None or len(candidates) == 1
        tried: list[str] = []  # why the larger quants were passed over
        chosen: tuple[str | None, list[RemoteFile], FitVerdict, str] | None = None
        smaller_ctx: tuple[str | None, list[RemoteFile], FitVerdict] | None = None
        refusal: FitVerdict | None = None  # the last (smallest) quant's that never fits
        ceiling = machine_limit(self.settings)[0].ceiling
        for i, (quant, shards) in enumerate(candidates):
            label = quant or Path(shards[0].path).name
            size = sum(f.size for f in shards)
            if not named and size > ceiling and i < len(candidates) - 1:
                # its weights alone are over the load ceiling: no header needed to say no
                tried.append(f"{label}'s {fs(size)} of weights are over the load ceiling")
                continue
            spec = self._call(
                repo_id,
                shards[0].path,
                functools.partial(
                    _gguf_spec, reader, repo_id, commit, shards, dest, proj_info, self
                ),
            )
            fit = check_fit(spec, self.settings)
            if named:
                how = "as asked" if want.quant is not None else "the repository's only model"
                chosen = (quant, shards, fit, f"{label} ({fs(size)}), {how}")
                break
            if fit.verdict == FITS:
                chosen = (quant, shards, fit, f"{label} ({fs(size)}), the largest quant that fits")
                break
            if fit.verdict == FITS_AT_CTX:  # a smaller quant may fit as the settings are
                smaller_ctx = smaller_ctx or (quant, shards, fit)
                tried.append(f"{label} fits only at --ctx {fit.largest_ctx}")
                continue
            tried.append(f"{label} needs {fs(fit.footprint)}")
            refusal = fit
        if chosen is None and smaller_ctx is not None:
            quant, shards, fit = smaller_ctx
            label = quant or Path(shards[0].path).name
            chosen = (quant, shards, fit, f"{label}, the largest quant that fits at all")
        if chosen is None:
            assert refusal is not None and refusal.error is not None
            if not force:
                err = refusal.error
                err.message = (
                    f"no quant of {repo_id} fits this machine ({'; '.join(tried)}): "
                    + last_message(err.message)
                )
                err.args = (err.message,)
                raise err
            quant, shards = candidates[-1]
            label = quant or Path(shards[0].path).name
            chosen = (quant, shards, refusal, f"{label}, the smallest, forced (none fits)")
        quant, shards, fit, why = chosen
        if tried:
            why += f" (larger ones do not: {'; '.join(tried)})"
        if not fit.ok and not force:
            assert fit.error is not None
            raise fit.error
        files_ = [*(shards[1:]), shards[0]]  # the first shard, which lists the model, last
        if projector is not None:
            files_.insert(0, projector)
            why += f"; with the vision projector {projector.path}"
        choice = Choice(
            ModelKind.LLM, tuple(files_), shards[0].path, quant, tuple(shards), projector
        )
        return PullPlan(repo_id, "main", commit, choice, dest, why, fit)

    def _check_disk(self, plan: PullPlan) -> None:
        storage = _storage(plan.repo_id)
        need = 0
        for f in plan.choice.files:
            if _cached_blob(storage, plan.commit, f.path) is not None:
                continue
            partial = _partial_size(storage, f)
            need += max(0, f.size - partial)
        plan.to_download = need
        probe = storage
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        free = shutil.disk_usage(probe).free
        plan.disk_free = free
        if need + DISK_MARGIN > free:
            raise InsufficientStorage(
                f"not enough disk space for {plan.repo_id}: {fs(need)} to download (plus "
                f"{fs(DISK_MARGIN)} kept free) but {fs(free)} free in {probe}; free some "
                "space or point HF_HUB_CACHE at a larger disk",
                code="insufficient_storage",
                details={"needed": need, "free": free, "path": str(probe)},
            )

    # -- 4. download

    def download(self, plan: PullPlan) -> PullResult:
        from huggingface_hub import hf_hub_url

        started = time.monotonic()
        storage = _storage(plan.repo_id)
        downloaded = resumed = 0
        pointers: dict[str, Path] = {}
        for f in plan.choice.files:
            digest = f"sha256:{f.sha256}" if f.sha256 else f"file:{f.path}"
            status = f"downloading {f.path}"
            cached = _cached_blob(storage, plan.commit, f.path)
            if cached is not None:
                self.emit(status=status, digest=digest, total=f.size, completed=f.size)
                pointers[f.path] = cached
                continue
            url = hf_hub_url(plan.repo_id, f.path, revision=plan.commit, endpoint=self.endpoint)
            got, kept, pointer = self._call(
                plan.repo_id,
                f.path,
                functools.partial(self._fetch, plan, storage, f, url, digest, status),
            )
            downloaded += got
            resumed += kept
            pointers[f.path] = pointer
        self.emit(status="verifying sha256 digest")
        self.emit(status="writing manifest")
        anchor = _install(plan, pointers)
        model_id = _catalog_id(self.settings, anchor, plan.dest)
        self.emit(status="success")
        return PullResult(plan, model_id, anchor, downloaded, resumed, time.monotonic() - started)

    def _fetch(
        self,
        plan: PullPlan,
        storage: Path,
        f: RemoteFile,
        url: str,
        digest: str,
        status: str,
    ) -> tuple[int, int, Path]:
        from huggingface_hub import get_hf_file_metadata

        meta = get_hf_file_metadata(url, token=self.token or False, headers=None)
        etag = meta.etag or f.sha256 or uuid.uuid4().hex
        blobs = storage / "blobs"
        blobs.mkdir(parents=True, exist_ok=True)
        blob = blobs / etag
        partial = blobs / f"{etag}.incomplete"
        # Another pull of the same file (the CLI beside a server's /api/pull, or
        # huggingface_hub itself: the same lock file) waits here rather than append to the
        # same partial file.
        locks = storage.parent / ".locks" / storage.name
        locks.mkdir(parents=True, exist_ok=True)
        with (locks / f"{etag}.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return self._fetch_locked(plan, storage, f, url, meta, blob, partial, digest, status)

    def _fetch_locked(
        self,
        plan: PullPlan,
        storage: Path,
        f: RemoteFile,
        url: str,
        meta: Any,
        blob: Path,
        partial: Path,
        digest: str,
        status: str,
    ) -> tuple[int, int, Path]:
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils._headers import build_hf_headers

        headers = build_hf_headers(token=self.token or False)
        size = meta.size if meta.size is not None else f.size
        kept = partial.stat().st_size if partial.exists() and not blob.exists() else 0
        if kept > size:
            partial.unlink()
            kept = 0
        already = blob.exists()  # another revision's, or a pull that ran meanwhile
        self.emit(status=status, digest=digest, total=size, completed=size if already else kept)
        if not already:
            sink = _ProgressFile(partial, self, status, digest, size, kept)
            try:
                http_get(
                    meta.location or url,
                    sink,  # type: ignore[arg-type]
                    resume_size=kept,
                    headers=headers,
                    expected_size=size,
                )
            except _Cancelled:
                raise PullCancelled(
                    f"the pull of {plan.repo_id} was cancelled; {f.path} is kept in part "
                    "and the next pull resumes it",
                    code="pull_cancelled",
                ) from None
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    partial.unlink(missing_ok=True)
                    raise InsufficientStorage(
                        f"the disk filled up while downloading {f.path} of {plan.repo_id} "
                        f"({exc.strerror}); the partial file was removed and nothing was "
                        "installed: free some space and pull again",
                        code="disk_full",
                    ) from exc
                raise
            finally:
                sink.close()
            if partial.stat().st_size != size:
                partial.unlink(missing_ok=True)
                raise ChecksumMismatch(
                    f"{f.path} of {plan.repo_id} came with {partial.stat().st_size} bytes, "
                    f"not {size}; removed: pull again",
                    code="size_mismatch",
                )
            if f.sha256 is not None:
                self.emit(status="verifying sha256 digest", digest=digest)
                actual = _sha256(partial)
                if actual != f.sha256:
                    partial.unlink(missing_ok=True)
                    raise ChecksumMismatch(
                        f"{f.path} of {plan.repo_id} is corrupt: its sha256 is {actual}, "
                        f"the Hub says {f.sha256}; the file was removed and nothing was "
                        "installed: pull again",
                        code="checksum_mismatch",
                        details={"file": f.path, "expected": f.sha256, "actual": actual},
                    )
            os.replace(partial, blob)
        pointer = storage / "snapshots" / plan.commit / f.path
        pointer.parent.mkdir(parents=True, exist_ok=True)
        _link(pointer, Path(os.path.relpath(blob, pointer.parent)))
        refs = storage / "refs"
        refs.mkdir(exist_ok=True)
        if plan.revision != plan.commit:
            (refs / plan.revision.replace("/", "%2F")).write_text(plan.commit)
        return (0, 0, pointer) if already else (size - kept, kept, pointer)

    def pull(
        self,
        name: str | PullName,
        *,
        file: str | None = None,
        revision: str | None = None,
        force: bool = False,
    ) -> PullResult:
        return self.download(self.plan(name, file=file, revision=revision, force=force))


def last_message(text: str) -> str:
    return text[0].lower() + text[1:] if text else text


class _Cancelled(Exception):
    pass


class _ProgressFile:
    """The partial file http_get writes to, reporting progress (at most ~10 times a second)
    and stopping when the pull is cancelled."""

    def __init__(
        self, path: Path, puller: Puller, status: str, digest: str, total: int, kept: int
    ) -> None:
        self._fh = path.open("ab")
        self._puller = puller
        self._status, self._digest, self._total = status, digest, total
        self.completed = kept
        self._last = 0.0

    def write(self, data: bytes) -> int:
        if self._puller.cancel.is_set():
            raise _Cancelled()
        n = self._fh.write(data)
        self.completed += n
        now = time.monotonic()
        if now - self._last >= 0.1 or self.completed >= self._total:
            self._last = now
            self._puller.emit(
                status=self._status,
                digest=self._digest,
                total=self._total,
                completed=self.completed,
            )
        return n

    def tell(self) -> int:
        return self._fh.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._fh.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        n = self._fh.truncate(size)
        self.completed = self._fh.tell()
        return n

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()


def _is_transport_error(exc: Exception) -> bool:
    try:
        import httpx2
    except ImportError:  # pragma: no cover - huggingface_hub < 2 used httpx
        import httpx as httpx2  # type: ignore[no-redef]
    return isinstance(exc, httpx2.TransportError)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


def _partial_size(storage: Path, f: RemoteFile) -> int:
    if f.sha256 is None:
        return 0
    try:
        return (storage / "blobs" / f"{f.sha256}.incomplete").stat().st_size
    except OSError:
        return 0


def _cached_blob(storage: Path, commit: str, path: str) -> Path | None:
    pointer = storage / "snapshots" / commit / path
    return pointer if pointer.exists() else None


def _link(at: Path, target: Path) -> None:
    """A symlink ``at`` → ``target``, made under a hidden name and renamed into place."""
    tmp = at.with_name(f".{at.name}.{uuid.uuid4().hex[:8]}.tmp")
    os.symlink(target, tmp)
    os.replace(tmp, at)


def _install(plan: PullPlan, pointers: dict[str, Path]) -> Path:
    """Link every file into the model's folder, the anchor last; return the anchor's link."""
    plan.dest.mkdir(parents=True, exist_ok=True)
    anchor = plan.dest / plan.choice.anchor
    for f in plan.choice.files:  # the anchor is the last of them
        at = plan.dest / f.path
        at.parent.mkdir(parents=True, exist_ok=True)
        _link(at, pointers[f.path].resolve())
    return anchor


def _catalog_id(settings: Settings, path: Path, folder: Path) -> str | None:
    """The id the catalog gives the model at ``path`` (a file), or ``folder`` (whisper)."""
    real = {path.resolve(), folder.resolve()}
    for spec in discover(settings).list():
        if spec.path.resolve() in real:
            return spec.id
    return None


# --- specs for the fit check ----------------------------------------------------------


def _projector_info(reader: Any, url: str, f: RemoteFile, dest: Path) -> Any:
    from elbowroom.models.vision import projector_from_header

    header = reader.header(url, f.size, f.path)
    return projector_from_header(header, dest / f.path)


def _gguf_spec(
    reader: Any,
    repo_id: str,
    commit: str,
    shards: list[RemoteFile],
    dest: Path,
    projector: Any,
    puller: Puller,
) -> ModelSpec:
    from huggingface_hub import hf_hub_url

    from elbowroom.pull.remote_gguf import merge_shards, remote_info

    headers = []
    for f in shards:
        url = hf_hub_url(repo_id, f.path, revision=commit, endpoint=puller.endpoint)
        headers.append(reader.header(url, f.size, f.path))
    info = remote_info(merge_shards(headers), shards[0].path)
    shard = _SHARD_RE.match(Path(shards[0].path).name)
    name = shard["base"] if shard else Path(shards[0].path).stem
    return ModelSpec(
        id=slug(name),
        kind=ModelKind.LLM,
        engine="llama",
        path=dest / shards[0].path,
        size_bytes=sum(f.size for f in shards),
        holding=Holding.MMAP,
        source="pull",
        gguf=info,
        projector=projector,
    )


def _resident_spec(choice: Choice, dest: Path) -> ModelSpec:
    engine = "whisper" if choice.kind == ModelKind.ASR else "onnx-embed"
    size = (
        sum(f.size for f in choice.files)
        if choice.kind == ModelKind.ASR
        else next(f.size for f in choice.files if f.path == choice.anchor)
    )
    return ModelSpec(
        id=slug(dest.name),
        kind=choice.kind,
        engine=engine,
        path=dest / choice.anchor,
        size_bytes=size,
        holding=Holding.RESIDENT,
        source="pull",
    )


# --- rm -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Removed:
    model_id: str
    paths: tuple[Path, ...]  # links removed from the models folder
    freed: int  # bytes of cached blobs deleted


def pulled_root(settings: Settings) -> Path:
    return settings.models_path / HUB_FOLDER


def remove(settings: Settings, spec: ModelSpec) -> Removed:
    """Delete a pulled model: its links in the models folder, then the cached files no
    other link uses. A model elbowroom did not pull is never deleted (a 400)."""
    check_pulled(settings, spec)
    root = pulled_root(settings).resolve()
    link = spec.path if spec.engine == "llama" else _model_folder(spec)
    if spec.engine == "llama":
        links = [link]
        shard = _SHARD_RE.match(link.name)
        if shard:
            count, width = int(shard["count"]), len(shard["count"])
            links = [
                link.with_name(f"{shard['base']}-{i:0{width}d}-of-{shard['count']}.gguf")
                for i in range(1, count + 1)
            ]
        projector = spec.projector.path if spec.projector is not None else None
        if projector is not None and projector.parent == link.parent:
            others = [
                p
                for p in link.parent.glob("*.gguf")
                if p not in links and p != projector and not _is_projector(p.name)
            ]
            if not others:
                links.append(projector)
        links.insert(0, links.pop(0))  # the anchor first: the model disappears at once
    else:
        folder = link
        links = sorted((p for p in folder.rglob("*") if p.is_symlink()), key=_anchor_first)
    blobs: list[Path] = []
    for p in links:
        with contextlib.suppress(OSError):
            blobs.append(p.resolve(strict=True))
        p.unlink(missing_ok=True)
    freed = _drop_unused(blobs, settings)
    _prune(links[0].parent if links else link, root)
    return Removed(spec.id, tuple(links), freed)


def check_pulled(settings: Settings, spec: ModelSpec) -> None:
    """A 400 unless ``spec`` is a model `elbowroom pull` installed (under models_dir/hf.co)."""
    root = pulled_root(settings).resolve()
    link = spec.path if spec.engine == "llama" else _model_folder(spec)
    try:
        inside = link.parent.resolve().is_relative_to(root)
    except OSError:
        inside = False
    if not inside:
        raise BadRequest(
            f"model {spec.id!r} was not pulled by elbowroom ({spec.path}): elbowroom deletes "
            "only what it downloaded; remove that file yourself",
            param="model",
            code="not_pulled",
        )


def _model_folder(spec: ModelSpec) -> Path:
    # whisper: the folder itself; onnx-embed: [folder/]onnx/model.onnx
    path = spec.path
    if spec.engine == "onnx-embed":
        path = path.parent
        if path.name == "onnx":
            path = path.parent
    return path if path.is_dir() else path.parent


def _anchor_first(p: Path) -> int:
    return 0 if p.name in ("model.bin", "model.onnx") else 1


def _drop_unused(blobs: list[Path], settings: Settings) -> int:
    """Delete cached blobs no link under the pulled folder still points at, with their
    snapshot pointers."""
    root = pulled_root(settings)
    used = set()
    if root.exists():
        for p in root.rglob("*"):
            if p.is_symlink():
                with contextlib.suppress(OSError):
                    used.add(p.resolve(strict=True))
    freed = 0
    for blob in blobs:
        if blob in used or blob.parent.name != "blobs":
            continue
        storage = blob.parent.parent
        for pointer in (storage / "snapshots").rglob("*"):
            if pointer.is_symlink():
                try:
                    if pointer.resolve() == blob:
                        pointer.unlink()
                except OSError:
                    pass
        try:
            freed += blob.stat().st_size
            blob.unlink()
        except OSError:
            pass
    return freed


def _prune(folder: Path, root: Path) -> None:
    """Remove empty folders from ``folder`` up to (not including) ``root``."""
    folder = folder.resolve() if folder.exists() else folder
    while folder != root and folder.is_relative_to(root):
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def pulled_specs(settings: Settings, catalog: Any, name: str) -> list[ModelSpec]:
    """The models ``name`` means: a catalog id (an Ollama ``:latest`` tag ignored), or the
    name a model was pulled by (hf.co/USER/REPO[:QUANT]: every model pulled from that
    repository, or that quant). 404 when nothing matches."""
    from elbowroom.errors import ModelNotFound

    for candidate in (name, name.removesuffix(":latest")):
        with contextlib.suppress(ModelNotFound):
            return [catalog.get(candidate)]
    try:
        want: PullName | None = parse_name(name)
    except BadRequest:
        want = None
    if want is not None:
        folder = (pulled_root(settings) / Path(*want.repo_id.split("/"))).resolve()
        specs = [
            s
            for s in catalog.list()
            if _under(s.path, folder)
            and (want.quant is None or (quant_of(s.path.name) or "") == want.quant.upper())
        ]
        if specs:
            return specs
    raise RepoNotFound(
        f"no model {name!r} to delete: `elbowroom ls` lists the models (ids), and pulled "
        "ones can also be named as they were pulled (hf.co/USER/REPO[:QUANT])",
        param="model",
        code="model_not_found",
    )


def remove_by_name(settings: Settings, catalog: Any, name: str) -> list[Removed]:
    return [remove(settings, s) for s in pulled_specs(settings, catalog, name)]


def _under(path: Path, folder: Path) -> bool:
    try:
        return path.parent.resolve().is_relative_to(folder) or path.parent.resolve() == folder
    except OSError:
        return False

"""The catalog: every model elbowroom can serve, by id.

Sources, in order (an earlier source keeps an id when two collide):
1. bundled packages (``bundled.py``), with fixed ids;
2. every model under ``settings.models_path`` (default ``data_dir/models``), searched
   recursively (hidden entries skipped, symlinks followed once);
3. each entry of ``settings.model_paths``: a model file, a model folder, or a folder to search.

What counts as a model:
- ``*.gguf`` with the GGUF magic → LLM (llama). ``mmproj*.gguf`` are projectors, never
  listed: one beside a model (name rule in models/vision.py), or named for it in
  ``settings.model_projectors`` (``ID=PATH``), gives that model vision. Split models
  (``x-00001-of-00003.gguf``) are listed once, by their first shard, with the size of all
  shards.
- a folder with ``model.bin`` + ``config.json`` → whisper (CTranslate2), ASR.
- a folder with ``config.json`` (a ``model_type``) + ``*.safetensors`` + a tokenizer → an
  MLX LLM (engine ``mlx``, models/mlx_meta.py; served with the ``mlx`` extra).
- a folder with ``model.onnx`` (or ``onnx/model.onnx``) + ``tokenizer.json`` → onnx-embed.
- ``X.onnx`` with ``X.onnx.json`` beside it → piper voice, TTS.

Ids are lowercase and URL-safe (``[a-z0-9][a-z0-9._-]*``, at most 64 characters), derived
from the file or folder name, in sorted path order so they are stable; a collision gets
``-2``, ``-3``... An id is only ever a key into this table: a request for
``../../etc/passwd`` is simply not found. Files that look like models but cannot be read are
kept in ``Catalog.problems`` (shown by ``elbowroom ls``) rather than failing discovery.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from elbowroom.config import Settings
from elbowroom.errors import ModelNotFound
from elbowroom.models.bundled import bundled_specs, tree_size
from elbowroom.models.gguf_meta import InvalidModel, is_mmproj, read_gguf_info
from elbowroom.models.mlx_meta import InvalidMLX, is_mlx_dir, read_mlx_info
from elbowroom.models.spec import GGUFInfo, Holding, ModelKind, ModelSpec
from elbowroom.models.vision import read_projector

log = logging.getLogger(__name__)

ID_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
MAX_ID = 64
MAX_DEPTH = 6  # how deep discovery searches below a models folder
_SHARD_RE = re.compile(r"^(?P<base>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.I)
_SKIP_SUFFIXES = (".part", ".tmp", ".partial", ".download", ".incomplete")


@dataclass(frozen=True, slots=True)
class Problem:
    path: Path
    reason: str


# Ollama's default tag: "smollm2-135m:latest" names the model "smollm2-135m" everywhere (an id
# is a slug, so it never has a tag of its own); /api/tags and /api/ps list names with it.
LATEST = ":latest"


class Catalog:
    def __init__(self, specs: Iterable[ModelSpec], problems: Iterable[Problem] = ()) -> None:
        self._specs: dict[str, ModelSpec] = {}
        for spec in specs:
            if spec.id in self._specs:
                raise ValueError(f"duplicate model id {spec.id!r}")
            self._specs[spec.id] = spec
        self.problems: tuple[Problem, ...] = tuple(problems)

    def list(self) -> list[ModelSpec]:
        return list(self._specs.values())

    def get(self, model_id: str) -> ModelSpec:
        spec = self._specs.get(model_id) if isinstance(model_id, str) else None
        if spec is None and isinstance(model_id, str) and model_id.endswith(LATEST):
            spec = self._specs.get(model_id[: -len(LATEST)])  # Ollama's name of the same
        if spec is None:
            raise ModelNotFound(str(model_id))
        return spec

    def __contains__(self, model_id: object) -> bool:
        return isinstance(model_id, str) and model_id in self._specs

    def __iter__(self) -> Iterator[ModelSpec]:
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    def refresh_from(self, other: Catalog) -> None:
        """Take ``other``'s models and problems (a discovery after a pull or a delete), in
        place: whoever holds this catalog (scheduler, lanes, routes) sees the change."""
        self._specs = dict(other._specs)
        self.problems = other.problems


def slug(name: str) -> str:
    """A file or folder name as an id: lowercase, URL-safe, at most 64 characters."""
    text = re.sub(r"[^a-z0-9._-]+", "-", name.lower())
    text = re.sub(r"([._-])[._-]+", r"\1", text)  # no runs like "--" or "._"
    text = text.lstrip("._-")[:MAX_ID].rstrip("._-")
    return text or "model"


def unique_id(base: str, taken: set[str]) -> str:
    if base not in taken:
        return base
    n = 2
    while True:
        suffix = f"-{n}"
        candidate = base[: MAX_ID - len(suffix)].rstrip("._-") + suffix
        if candidate not in taken:
            return candidate
        n += 1


# --- recognising models


def _is_whisper_dir(path: Path) -> bool:
    return (path / "model.bin").is_file() and (path / "config.json").is_file()


def _embed_onnx(path: Path) -> Path | None:
    if not (path / "tokenizer.json").is_file():
        return None
    for candidate in (path / "model.onnx", path / "onnx" / "model.onnx"):
        if candidate.is_file():
            return candidate
    return None


def _spec(
    name: str,
    kind: ModelKind,
    engine: str,
    path: Path,
    size: int,
    holding: Holding,
    *,
    gguf: GGUFInfo | None = None,
    description: str = "",
    options: dict[str, str] | None = None,
) -> ModelSpec:
    # The id is derived from ``name`` here and made unique later, by _assign_ids.
    return ModelSpec(
        id=slug(name),
        kind=kind,
        engine=engine,
        path=path,
        size_bytes=size,
        holding=holding,
        source="",
        gguf=gguf,
        description=description,
        options=options or {},
    )


def _folder_model(path: Path) -> ModelSpec | None:
    if _is_whisper_dir(path):
        return _spec(path.name, ModelKind.ASR, "whisper", path, tree_size(path), Holding.RESIDENT)
    if is_mlx_dir(path):
        return _mlx_model(path)
    onnx = _embed_onnx(path)
    if onnx is not None:
        return _spec(
            path.name,
            ModelKind.EMBEDDING,
            "onnx-embed",
            onnx,
            onnx.stat().st_size,
            Holding.RESIDENT,
            options={"tokenizer": str(path / "tokenizer.json")},
        )
    return None


def _mlx_model(path: Path) -> ModelSpec:
    try:
        info = read_mlx_info(path)
    except InvalidMLX as exc:
        raise InvalidModel(f"MLX model folder {path.name}: {exc}") from exc
    spec = _spec(
        path.name,
        ModelKind.LLM,
        "mlx",
        path,
        info.tensor_bytes,
        Holding.RESIDENT,  # MLX copies its weights into anonymous (unified) memory
        description=f"{path.name} (MLX {info.model_type}, {info.quantization})",
    )
    return replace(spec, mlx=info)


def _gguf_model(path: Path) -> ModelSpec | None:
    name = path.name
    size = path.stat().st_size
    shard = _SHARD_RE.match(name)
    if shard:
        if int(shard["index"]) != 1:
            return None  # listed through its first shard
        count = int(shard["count"])
        width = len(shard["count"])
        shards = [
            path.with_name(f"{shard['base']}-{i:0{width}d}-of-{shard['count']}.gguf")
            for i in range(1, count + 1)
        ]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise InvalidModel(f"split model {name} is missing shards: {', '.join(missing)}")
        size = sum(s.stat().st_size for s in shards)
        name = shard["base"]
    else:
        name = path.stem
    info = read_gguf_info(path)
    return _spec(
        name,
        ModelKind.LLM,
        "llama",
        path,
        size,
        Holding.MMAP,
        gguf=info,
        description=f"{info.name} ({info.architecture}, {info.file_type or 'unknown type'})",
    )


def _file_model(path: Path) -> ModelSpec | None:
    lower = path.name.lower()
    if lower.endswith(".gguf"):
        return None if is_mmproj(path) else _gguf_model(path)
    if lower.endswith(".onnx") and Path(f"{path}.json").is_file():
        return _spec(
            path.stem,
            ModelKind.TTS,
            "piper",
            path,
            path.stat().st_size,
            Holding.RESIDENT,
            options={"config": f"{path}.json"},
        )
    return None


def _search(root: Path, problems: list[Problem]) -> list[ModelSpec]:
    """Every model under ``root`` (a model folder counts as one model)."""
    found: list[ModelSpec] = []
    seen: set[Path] = set()

    def visit(folder: Path, depth: int) -> None:
        # Anything that cannot be stat'ed or read (a symlink into /proc/1/cwd, a folder
        # without the x bit) is listed under problems; it must not stop serve or ls.
        try:
            real = folder.resolve()
            if real in seen or depth > MAX_DEPTH:
                return
            seen.add(real)
            try:
                model = _folder_model(folder)
            except InvalidModel as exc:  # an MLX folder that cannot be read
                problems.append(Problem(folder, exc.message))
                return
            if model is not None:
                found.append(model)
                return
            entries = sorted(folder.iterdir())
        except OSError as exc:
            problems.append(Problem(folder, f"cannot list: {exc.strerror or exc}"))
            return
        for entry in entries:
            if entry.name.startswith(".") or entry.name.lower().endswith(_SKIP_SUFFIXES):
                continue
            try:
                is_dir = entry.is_dir()
                is_file = not is_dir and entry.is_file()
            except OSError as exc:
                problems.append(Problem(entry, f"cannot read: {exc.strerror or exc}"))
                continue
            if is_dir:
                visit(entry, depth + 1)
            elif is_file:
                _try(entry, _file_model, found, problems)

    visit(root, 0)
    return found


def _try(
    path: Path,
    find: Callable[[Path], ModelSpec | None],
    found: list[ModelSpec],
    problems: list[Problem],
) -> None:
    try:
        model = find(path)
    except InvalidModel as exc:
        problems.append(Problem(path, exc.message))
        log.warning("skipping %s: %s", path, exc.message)
        return
    except OSError as exc:
        problems.append(Problem(path, f"cannot read: {exc.strerror or exc}"))
        return
    except Exception as exc:  # a file we did not foresee must not stop discovery (serve, ls)
        problems.append(Problem(path, f"cannot be read as a model: {type(exc).__name__}: {exc}"))
        log.warning("skipping %s: unexpected %s", path, type(exc).__name__, exc_info=exc)
        return
    if model is not None:
        found.append(model)


def _from_path(path: Path, problems: list[Problem]) -> list[ModelSpec]:
    """One ``model_paths`` entry: a model file, a model folder, or a folder to search."""
    try:
        is_file, is_dir = path.is_file(), path.is_dir()
    except OSError as exc:
        problems.append(Problem(path, f"cannot read: {exc.strerror or exc}"))
        return []
    if is_file:
        found: list[ModelSpec] = []
        before = len(problems)
        _try(path, _file_model, found, problems)
        if not found and len(problems) == before:
            problems.append(Problem(path, "not a model file (.gguf, or .onnx with .onnx.json)"))
        return found
    if is_dir:
        return _search(path, problems)
    problems.append(Problem(path, "no such file or folder"))
    return []


def _assign_ids(specs: list[ModelSpec], source: str, taken: set[str]) -> list[ModelSpec]:
    out = []
    for spec in specs:
        model_id = unique_id(spec.id, taken)
        taken.add(model_id)
        out.append(replace(spec, id=model_id, source=source))
    return out


def discover(settings: Settings) -> Catalog:
    """Bundled models, then the models folder, then ``settings.model_paths``."""
    problems: list[Problem] = []
    specs = bundled_specs(settings)
    taken = {s.id for s in specs}
    paths_seen = {s.path.resolve() for s in specs}

    def add(found: list[ModelSpec], source: str) -> None:
        fresh = []
        for spec in found:
            real = spec.path.resolve()
            if real not in paths_seen:  # the same file through two sources is listed once
                paths_seen.add(real)
                fresh.append(spec)
        specs.extend(_assign_ids(fresh, source, taken))

    if settings.models_path.is_dir():
        add(_search(settings.models_path, problems), "models_dir")
    for path in settings.model_paths:
        add(_from_path(Path(path).expanduser(), problems), "path")
    return Catalog(_attach_projectors(specs, settings, problems), problems)


def _attach_projectors(
    specs: list[ModelSpec], settings: Settings, problems: list[Problem]
) -> list[ModelSpec]:
    """Give vision to the LLMs with a projector: named in ``model_projectors``, else found
    beside them. An unreadable projector is a problem; its model stays a text model."""
    named: dict[str, Path] = {}
    for item in settings.model_projectors:
        model_id, _, text = item.partition("=")
        named[model_id.strip()] = Path(text.strip()).expanduser()
    known = {s.id for s in specs}
    for model_id, path in named.items():
        if model_id not in known:
            problems.append(Problem(path, f"model_projectors names {model_id!r}: no such model"))
    out = []
    for spec in specs:
        where_ = named.get(spec.id) or (spec.gguf.mmproj if spec.gguf is not None else None)
        if where_ is not None and spec.kind == ModelKind.LLM:
            try:
                spec = replace(spec, projector=read_projector(where_))
            except InvalidModel as exc:
                problems.append(Problem(where_, f"projector of {spec.id}: {exc.message}"))
            except OSError as exc:
                problems.append(Problem(where_, f"cannot read: {exc.strerror or exc}"))
        out.append(spec)
    return out

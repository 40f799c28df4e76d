"""Which build of the LLM engine is installed, as far as memory is concerned.

Two things change what a runner holds in host RAM for the same model and settings
(``models/estimate.py``'s build-dependent terms):

- ``cuda``: the extension links CUDA's libraries (read from its ELF dynamic section, its
  ``DT_NEEDED`` entries, without importing it: importing the CUDA build would load CUDA
  into the server process). Its runners map cuBLAS and the driver even on the CPU.
- ``amx``: a build compiled for this machine's CPU (a source build: ``GGML_NATIVE`` is on
  unless the wheel is a portable release, which PyPI's ``manylinux`` wheels are) on a CPU
  with AMX (``amx_int8`` and ``avx512_vnni`` in /proc/cpuinfo). llama.cpp's CPU backend
  then copies every matrix weight of the types AMX multiplies (f16, q4_0, q4_1, q8_0,
  q4_K, q5_K, q6_K, iq4_xs) into its AMX buffer, whenever no GPU is visible to the runner
  (with a GPU visible, the GPU's pinned host buffer type comes first and takes them).
"""

from __future__ import annotations

import functools
import importlib.util
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CPU", "CUDA", "EngineBuild", "engine_build", "needed_libraries"]

CPU = "cpu"
CUDA = "cuda"
_CUDA_LIBS = ("libcudart", "libcublas", "libcuda.so")


def needed_libraries(path: Path) -> list[str]:
    """The ``DT_NEEDED`` entries of an ELF64 little-endian shared object; [] otherwise."""
    try:
        with path.open("rb") as fh:
            ident = fh.read(64)
            if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
                return []
            shoff = struct.unpack_from("<Q", ident, 0x28)[0]
            shentsize, shnum = struct.unpack_from("<HH", ident, 0x3A)
            fh.seek(shoff)
            table = fh.read(shentsize * shnum)
            sections = [
                struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)
            ]
            for _name, kind, _flags, _addr, offset, size, link, *_ in sections:
                if kind != 6:  # SHT_DYNAMIC
                    continue
                fh.seek(offset)
                dynamic = fh.read(size)
                strtab = sections[link]
                fh.seek(strtab[4])
                strings = fh.read(strtab[5])
                names = []
                for i in range(0, len(dynamic) - 15, 16):
                    tag, value = struct.unpack_from("<qQ", dynamic, i)
                    if tag == 0:
                        break
                    if tag == 1:  # DT_NEEDED
                        end = strings.index(b"\0", value)
                        names.append(strings[value:end].decode(errors="replace"))
                return names
    except (OSError, struct.error, ValueError, IndexError):
        return []
    return []


@dataclass(frozen=True, slots=True)
class EngineBuild:
    gpu: str = CPU  # "cuda" or "cpu"
    amx: bool = False  # the CPU backend copies matrix weights into AMX buffers

    @property
    def cuda(self) -> bool:
        return self.gpu == CUDA


PORTABLE = EngineBuild()  # PyPI's CPU wheel, and what the estimate assumed before


def _package_dirs() -> list[Path]:
    try:
        spec = importlib.util.find_spec("xllamacpp")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def _portable_wheel(folders: list[Path]) -> bool:
    """The installed wheel is a portable release (a ``manylinux``/``macosx`` tag), not a
    build for this machine (a source build's wheel is tagged ``linux_x86_64``)."""
    for folder in folders:
        for wheel in folder.parent.glob("xllamacpp-*.dist-info/WHEEL"):
            try:
                tags = [ln for ln in wheel.read_text().splitlines() if ln.startswith("Tag:")]
            except OSError:
                continue
            return any("manylinux" in t or "macosx" in t or "musllinux" in t for t in tags)
    return True


def cpu_has_amx(cpuinfo: str | None = None) -> bool:
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "").split()
    return "amx_int8" in flags and "avx512_vnni" in flags


@functools.cache
def engine_build() -> EngineBuild:
    """The installed xllamacpp's build (``PORTABLE`` when it is not installed)."""
    folders = _package_dirs()
    cuda = any(
        any(n.startswith(_CUDA_LIBS) for n in needed_libraries(so))
        for folder in folders
        for so in folder.glob("*.so*")
    )
    native = bool(folders) and not _portable_wheel(folders)
    return EngineBuild(CUDA if cuda else CPU, native and cpu_has_amx())

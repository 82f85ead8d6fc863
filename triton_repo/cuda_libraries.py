"""Whether this process loaded one CUDA library from two places: a library path that shadows part of torch's own.

torch's wheels find their CUDA libraries (cuDNN, cuBLAS, NCCL, ...) through their RUNPATH, which the loader searches
after LD_LIBRARY_PATH. A directory on LD_LIBRARY_PATH that holds other builds of the same libraries (a GPU image's
/usr/lib/x86_64-linux-gnu, with the distribution's cuDNN) wins for every library loaded on demand, while the ones torch
loaded by absolute path stay the wheel's: the process then runs a mix of two builds. That cost the served LLM's
decode step 37 % on an H200 (docs/experiments/2026-12-02-h200-stub-library-path.md) without any error. The models
read /proc/self/maps once their engines are loaded and log a warning naming the directories; `triton_repo.server`
keeps such directories off the stubs' library path.

Pure apart from `check_cuda_libraries` (torch-free: only the process's memory map is read).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

#: CUDA library families whose builds must not mix; a family's libraries of one major version come from one place.
FAMILIES = ("cudnn", "cublas", "cudart", "nccl", "nvrtc", "nvJitLink", "cusparse", "cufft", "curand", "cusolver")

# lib<family><rest>[-<hash>].so.<major>[.<minor>...]: auditwheel's mangled copies (libcudart-09529672.so.12.6.77)
# keep their family and major version.
_LIBRARY = re.compile(rf"^lib({'|'.join(FAMILIES)})[A-Za-z0-9_]*(?:-[0-9a-f]{{8}})?\.so\.(\d+)")

MAPS = Path("/proc/self/maps")
#: What the warning says, for the tools that read server logs (`stack-bench` puts it in its results).
SHADOWED_MARK = "shadows part of torch's own CUDA libraries"


def library_dirs(maps: str) -> dict[tuple[str, int], set[str]]:
    """(family, major version) -> the directories the mapped libraries of that family and version come from."""
    dirs: dict[tuple[str, int], set[str]] = {}
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path (absent: anonymous memory)
        path = fields[5] if len(fields) == 6 else ""
        if not path.startswith("/"):
            continue
        match = _LIBRARY.match(os.path.basename(path))
        if match:
            dirs.setdefault((match[1], int(match[2])), set()).add(os.path.dirname(os.path.realpath(path)))
    return dirs


def mixed_libraries(maps: str) -> dict[tuple[str, int], list[str]]:
    """The families (and major versions) loaded from more than one directory, each with its directories, sorted."""
    return {key: sorted(found) for key, found in sorted(library_dirs(maps).items()) if len(found) > 1}


def check_cuda_libraries(logger: logging.Logger, maps_path: Path = MAPS) -> dict[tuple[str, int], list[str]]:
    """Log a warning for every CUDA library family this process loaded from several directories; returns them.
    Where the memory map cannot be read (not Linux) nothing is checked."""
    try:
        maps = maps_path.read_text()
    except OSError:
        return {}
    mixed = mixed_libraries(maps)
    for (family, major), found in mixed.items():
        logger.warning(
            "lib%s (version %d) is loaded from %d directories: %s. A directory on LD_LIBRARY_PATH %s and the GPU "
            "may run slower kernels: remove it from LD_LIBRARY_PATH (docs/triton.md, \"The stubs' library path\")",
            family, major, len(found), ", ".join(found), SHADOWED_MARK)
    return mixed

"""Content fingerprints of stage inputs, so that a stage re-runs exactly when what it reads has changed.

Files are hashed by content (sha256), because the same weights copied elsewhere must keep their fingerprint (the
engine metadata records it). Re-hashing multi-GB checkpoints on every run would be slow, so digests are cached
by (path, size, mtime): an unchanged file is hashed once.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tqdm import tqdm

_CHUNK = 8 << 20
_PROGRESS_MIN_BYTES = 256 << 20  # show a bar only where hashing takes a noticeable time


class DigestCache:
    """sha256 per file, persisted as JSON and keyed by (size, mtime_ns)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._entries: dict[str, list] = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            self._entries = {}

    def file_digest(self, file: Path) -> str:
        stat = file.stat()
        key = str(file.resolve())
        cached = self._entries.get(key)
        if cached and cached[0] == stat.st_size and cached[1] == stat.st_mtime_ns:
            return cached[2]
        digest = _sha256(file, stat.st_size)
        self._entries[key] = [stat.st_size, stat.st_mtime_ns, digest]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self._entries))
        return digest


def _sha256(file: Path, size: int) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f, tqdm(
        total=size, unit="B", unit_scale=True, desc=f"hash {file.name}", disable=size < _PROGRESS_MIN_BYTES
    ) as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def fingerprint(paths: list[Path], values: dict[str, object], cache: DigestCache) -> str:
    """One digest over the given files (directories: every file below, by relative path) and option values."""
    digest = hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode())
    for path in paths:
        files = sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts) if path.is_dir() else [path]
        for file in files:
            name = file.relative_to(path).as_posix() if path.is_dir() else file.name
            digest.update(f"{name}\0{cache.file_digest(file)}\n".encode())
    return digest.hexdigest()

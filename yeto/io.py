"""Small helpers every part of yeto shares: atomic files, finite numbers, addresses.

One place for each: a file that must never be seen half-written goes through
`atomic_write` (temp file in the same folder, fsync, rename, fsync of the folder),
a number that may be NaN goes through `finite_or_none` before it reaches JSON, and
a host and port become one address string through `host_port`, what yeto caches
lives under `cache_home`, and a JSONL file another process appends to is read as it
grows by `JsonlFollower`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "wb", *, durable: bool = True
                ) -> Iterator[IO[Any]]:
    """Open a temp file beside `path`; on success it replaces `path` in one rename.

    With `durable` the data and the rename are fsynced, so a power cut leaves the old
    file or the new one, never a torn one. On an error the temp file is removed and
    `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_dir(path.parent)


def atomic_write(path: str | Path, data: bytes | str, *, durable: bool = True) -> None:
    """Write `data` (bytes or text) to `path` atomically (see `atomic_file`)."""
    with atomic_file(path, "wb" if isinstance(data, bytes) else "w", durable=durable) as f:
        f.write(data)


def write_private(path: str | Path, text: str) -> None:
    """Write a secret (a token, a credential) to `path`, readable by this user only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def atomic_save(path: str | Path, save: Callable[[Path], Any]) -> None:
    """Atomically produce `path` with a writer that takes a file name (for libraries
    that write files themselves, e.g. `safetensors.numpy.save_file`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        save(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some filesystems cannot open folders; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def finite_or_none(x: Any) -> float | None:
    """A finite float, or None (for NaN, inf, None and non-numbers): JSON-safe."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def cache_home() -> Path:
    """Where yeto caches what it builds (tiny models, models read from GGUF):
    $YETO_CACHE, default ~/.cache/yeto."""
    return Path(os.environ.get("YETO_CACHE") or Path.home() / ".cache" / "yeto")


def host_port(host: str, port: int) -> str:
    """'host:port', with IPv6 hosts in brackets ('[::1]:29400')."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class JsonlFollower:
    """Reads the records appended to a JSONL file since the last call: only the new
    bytes; a partly written last line is left for the next read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.offset = 0
        self._partial = b""
        self.bad_lines = 0

    def read_new(self) -> list[dict[str, Any]]:
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return []
        if size < self.offset:  # truncated or replaced: start over
            self.offset, self._partial = 0, b""
        if size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        self.offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()  # b"" when the data ended with a newline
        out = []
        for line in lines:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                self.bad_lines += 1
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out

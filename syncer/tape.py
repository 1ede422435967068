"""The event tape: one JSON line per merge (and per rejected message), appended
and flushed as it happens so a crash loses at most the line being written."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path


class Tape:
    def __init__(self, path: Path | None):
        self.path = path
        self._lock = threading.Lock()
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self._file is None:
            return
        line = json.dumps(record, sort_keys=True, allow_nan=False, default=_plain)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _plain(x):
    return float(x) if hasattr(x, "__float__") else str(x)


def read_tape(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]

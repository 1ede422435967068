"""Metrics: JSONL files and an optional TensorBoard writer.

Every island writes ``<output>/metrics.jsonl`` through its `yeto.loop.IslandDriver`
(one JSON object per line: step, train_loss, eval_loss, version, ...); the syncer's
tape (``<state-dir>/tape.jsonl``) holds one line per merge. `yeto.io.JsonlFollower`
reads such a file as it grows, which is how `yeto launch`'s display and the dashboard
keep up with a run.

`MetricsWriter` appends records to a JSONL file and, with
``report_to="tensorboard"``, also writes every numeric field as a TensorBoard
scalar (``torch.utils.tensorboard``, else ``tensorboardX``). TensorBoard is an
optional dependency: asking for it without the package installed raises
`MetricsError` with the install command, before anything runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from yeto.io import finite_or_none

REPORT_TO = ("jsonl", "tensorboard")


class MetricsError(RuntimeError):
    """A metrics sink that cannot be used (e.g. TensorBoard not installed)."""


# ---- writing --------------------------------------------------------------------------
def check_report_to(report_to: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """Normalise ``--report-to`` (comma list or sequence) and check its sinks are usable."""
    if report_to is None or report_to == "":
        return ()
    names = report_to.split(",") if isinstance(report_to, str) else list(report_to)
    names = tuple(n.strip() for n in names if n.strip() and n.strip() != "none")
    bad = [n for n in names if n not in REPORT_TO]
    if bad:
        raise MetricsError(f"--report-to {','.join(bad)}: unknown; choose from "
                           f"{', '.join(REPORT_TO)} (example: --report-to tensorboard)")
    if "tensorboard" in names:
        tensorboard_writer_class()
    return names


def tensorboard_writer_class():
    """TensorBoard's SummaryWriter, or MetricsError saying how to install it."""
    try:
        from torch.utils.tensorboard import SummaryWriter
        return SummaryWriter
    except ImportError:
        pass
    try:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    except ImportError:
        pass
    raise MetricsError("--report-to tensorboard needs the tensorboard package, which is not "
                       "installed: pip install tensorboard  (then: tensorboard --logdir DIR). "
                       "The JSONL metrics are written either way.")


class MetricsWriter:
    """Appends records to ``<dir>/metrics.jsonl``; with ``report_to`` including
    "tensorboard", also writes each numeric field as a scalar under ``tb_dir``
    (default ``<dir>/tensorboard``), tagged ``<prefix>/<field>``."""

    def __init__(self, out_dir: str | Path | None, report_to=("jsonl",), *,
                 file_name: str = "metrics.jsonl", tb_dir: str | Path | None = None,
                 prefix: str = ""):
        sinks = check_report_to(report_to)
        self.path = Path(out_dir) / file_name if out_dir is not None else None
        self.jsonl = self.path is not None  # always: the JSONL is the record of the run
        self.prefix = prefix
        self._tb = None
        if "tensorboard" in sinks:
            base = tb_dir if tb_dir is not None else (
                Path(out_dir) / "tensorboard" if out_dir is not None else None)
            if base is None:
                raise MetricsError("--report-to tensorboard needs an output folder")
            self._tb = tensorboard_writer_class()(log_dir=str(base))

    def write(self, record: dict, step: int | None = None) -> None:
        """Append `record` as one JSON line; its numeric fields become TensorBoard
        scalars at `step` (default: the record's own "step")."""
        if self.jsonl:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, default=_plain) + "\n")
        if self._tb is not None:
            self.scalars(record, step if step is not None else record.get("step"))

    def scalars(self, record: dict, step: int | None, prefix: str | None = None) -> None:
        """TensorBoard only: each finite numeric field as a scalar at ``step``."""
        if self._tb is None:
            return
        prefix = self.prefix if prefix is None else prefix
        step = int(step) if finite_or_none(step) is not None else None
        for key, value in record.items():
            v = finite_or_none(value)
            if v is None or key in ("step", "time"):
                continue
            self._tb.add_scalar(f"{prefix}/{key}" if prefix else key, v, global_step=step,
                                walltime=record.get("time"))

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def tape_scalars(record: dict) -> dict[str, dict[str, float]]:
    """TensorBoard scalars of one tape merge record, by tag prefix: the run's
    bytes and timings under "syncer", each responder's loss, tokens and share
    under its learner id."""
    if record.get("event") != "merge":
        return {}
    out = {"syncer": {k: record[k] for k in ("bytes_in", "bytes_out", "merge_seconds",
                                              "round_seconds", "islands_live")
                      if finite_or_none(record.get(k)) is not None}}
    for r in record.get("responders", []):
        out[str(r.get("learner"))] = {
            k: r[k] for k in ("train_loss", "eval_loss", "tokens", "share", "staleness")
            if finite_or_none(r.get(k)) is not None}
    return out


def _plain(x):
    return float(x) if hasattr(x, "__float__") else str(x)

"""Where a run's metrics go: one CSV file for the whole run (a resume drops the rows of the steps it trains
again), TensorBoard, or wandb."""

from __future__ import annotations

import csv
import logging
import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only

from posgpt.core.errors import UserError
from posgpt.training.curves import METRICS_FILE, TENSORBOARD_DIR, cell_number, metric_files

log = logging.getLogger(__name__)


class _ContinuedWriter(ExperimentWriter):
    """Lightning's CSV writer, which deletes an existing metrics file, made to keep its rows before `start_step`
    (not those without a step: a killed launch's half-written last line)."""

    def __init__(self, log_dir: str, start_step: int) -> None:
        self.start_step = start_step
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        if not Path(self.metrics_file_path).is_file():
            return
        with open(self.metrics_file_path, newline="") as f:
            reader = csv.DictReader(f)
            rows = [
                row for row in reader if (step := cell_number(row.get("step"))) is not None and step < self.start_step
            ]
            self.metrics_keys = list(reader.fieldnames or [])
        if self.metrics_keys:
            with open(self.metrics_file_path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
                writer.writeheader()
                writer.writerows(rows)


class RunCSVLogger(CSVLogger):
    """`<run dir>/metrics.csv`, one file for the run: a resume from step S keeps the rows before S."""

    def __init__(self, run_dir: Path, start_step: int) -> None:
        super().__init__(save_dir=str(run_dir), name="", version="")
        if rank_zero_only.rank == 0:  # other ranks write nothing (Lightning's `experiment` is a dummy there)
            self._experiment = _ContinuedWriter(self.log_dir, start_step)

    def log_hyperparams(self, params: Any = None) -> None:
        """Nothing: config.yaml in the run directory is the run's configuration."""


def make_loggers(
    kind: str, run_dir: Path, start_step: int, wandb_project: str, config: dict[str, Any]
) -> list[Logger] | bool:
    """The run's own record, `<run dir>/metrics.csv` (training.png is drawn from it), and the logger `train.logger`
    adds to it (TensorBoard, wandb); False for none, no metrics at all. `start_step`: where a resumed run starts."""
    if kind == "none":
        return False
    record = RunCSVLogger(run_dir, start_step)
    if kind == "csv":
        return [record]
    if kind == "tensorboard":  # one directory for the run: a resume purges the steps it trains again
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise UserError("--train.logger tensorboard needs the tensorboard package: pip install tensorboard "
                            "(or pip install 'posgpt[tensorboard]'), or use --train.logger csv.") from None  # fmt: skip
        return [record, TensorBoardLogger(save_dir=str(run_dir), name=TENSORBOARD_DIR, version="",
                                          default_hp_metric=False, purge_step=start_step or None)]  # fmt: skip
    online = bool(os.environ.get("WANDB_API_KEY")) and os.environ.get("WANDB_MODE") != "offline"
    if online:  # and the server answers a TCP connection
        host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
        try:
            socket.create_connection((host, 443), timeout=3.0).close()
        except OSError:
            online = False
    if not online:
        log.info("wandb: no API key or no network; logging offline to %s/wandb (upload later: wandb sync)", run_dir)
    return [record, WandbLogger(project=wandb_project, name=run_dir.name, save_dir=str(run_dir), offline=not online,
                                config=config)]  # fmt: skip


def metrics_file(run_dir: Path) -> Path:
    """The CSV metrics of a run's latest launch: `<run dir>/metrics.csv`, or an older run's last per-launch file."""
    return (metric_files(run_dir) or [run_dir / METRICS_FILE])[-1]

"""Experiment trackers: every step's metrics go to TensorBoard (`tensorboard=true`, when installed) and to
each tracker `log.to` names, through its own library.

`metrics.jsonl` is always written (`rl/metrics_log.MetricsLog`); trackers are extra and optional. A tracker
`log.to` names whose library is not installed is refused before the run starts. Each library's own
offline mode applies: WANDB_MODE=offline, MLFLOW_TRACKING_URI (a file store in the run, mlruns/, by default), trackio's
local store.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from parity.config import ConfigError
from parity.folders import Folder

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}


class Tracker:
    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def _own_folder(run_dir: Path, name: str) -> Folder:
    """The tracker's folder in the run, made if missing and reached without following a link; the tracker
    keeps it open and writes through its descriptor (`Folder.path`)."""
    with Folder.open(run_dir, key="run_dir") as run:
        return run.sub(name, create=True)


class TensorBoard(Tracker):
    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self.folder = _own_folder(run_dir, "tensorboard")
        self.writer = SummaryWriter(str(self.folder.path()))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
        self.folder.close()


class WandB(Tracker):
    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]):
        import wandb

        # W&B and MLflow write their files by path and record it in them, so a descriptor's path would outlive
        # the process in their records: their folders are checked to be folders of the run, not links, instead.
        _own_folder(run_dir, "wandb").close()
        # resume="allow" with the run directory's name as id: a resumed Parity run continues its W&B run
        self.run = wandb.init(
            project=project, name=run_dir.name, id=_run_id(run_dir), dir=str(run_dir), config=config, resume="allow"
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackio(Tracker):
    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=project, name=run_dir.name, config=config, resume="allow")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.trackio.log(metrics, step=step)

    def close(self) -> None:
        self.trackio.finish()


class MLflow(Tracker):
    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]):
        import mlflow

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # A local store inside the run, not ./mlruns: MLflow's file store, which needs no database
            # package (mlflow-skinny has none) and which MLflow now serves only when allowed.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            _own_folder(run_dir, "mlruns").close()  # as W&B's
            mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(project)
        self.run = mlflow.start_run(run_name=run_dir.name)
        mlflow.log_params({k: str(v)[:500] for k, v in config.items()})  # mlflow caps a value's length

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({_mlflow_name(k): v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _mlflow_name(key: str) -> str:
    """A metric's name as MLflow takes it: its file store makes `a/b` a file and `a/b/c` a folder, which
    cannot both be (mismatch/k3 and mismatch/k3/len_1-16), so dots; no @ (pass@k)."""
    return key.replace("/", ".").replace("@", "_at_")


# What to do when a tracker cannot start, most often a run (or its resume) in a shell without the tracker's
# offline mode, account or network: log.to may change on resume.
HINTS = {
    "wandb": (
        "; the run logs to W&B (log.to=wandb): set WANDB_MODE=offline to keep its W&B files in the run's wandb/ "
        "without an account or the network (`wandb sync` uploads them later), log in (`wandb login`), or leave W&B "
        "out (log.to=[], which --resume also takes)"
    ),
}
TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB, "trackio": Trackio, "mlflow": MLflow}


def _run_id(run_dir: Path) -> str:
    """A stable id for the run directory (W&B ids allow letters, digits, - and _)."""
    import hashlib

    return hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]


def check_trackers(names: list[str]) -> None:
    """A tracker `log.to` names whose library is missing is a ConfigError."""
    for name in names:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise ConfigError(f"log.to: {name} is not installed (pip install {PACKAGES[name]}), or leave it out")


def open_trackers(
    tensorboard: bool, names: list[str], run_dir: Path, project: str, config: dict[str, Any]
) -> list[Tracker]:
    """TensorBoard when asked for and installed, and every tracker `log.to` names."""
    check_trackers(names)
    if tensorboard and importlib.util.find_spec("tensorboard") is not None:
        names = ["tensorboard", *names]
    opened: list[Tracker] = []
    for name in names:
        try:
            opened.append(TRACKERS[name](run_dir, project, config))
        except Exception as e:  # a tracker that cannot start (its server, its store): one line, not its traceback
            for tracker in opened:
                tracker.close()
            summary = " ".join(str(e).split())[:300].rstrip(".")
            hint = HINTS.get(name, "")
            raise ConfigError(f"log.to: {name} could not start: {type(e).__name__}: {summary}{hint}") from None
    return opened

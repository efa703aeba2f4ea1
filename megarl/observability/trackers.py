"""Experiment trackers: where each iteration's metrics (and the sample tables) go besides JSONL.

``trainer.loggers`` names them: ``jsonl`` (``<run_dir>/metrics.jsonl``, written by
:class:`megarl.observability.metrics.MetricsWriter`; the source of truth, always on), ``tensorboard``
(``<run_dir>/tensorboard/``), ``wandb`` and ``mlflow``.  wandb and mlflow are optional extras,
imported here only when a run names them; :func:`check_loggers` (a start-up check) refuses a named one that
is not installed, naming the extra.

Every tracker gets the numeric values of each metrics.jsonl row at ``step = iteration``, from
rank 0 only.  The tracker run carries the megarl run id, the resolved config and its hash.

Resume.  The tracker run ids are kept in ``<run_dir>/trackers.json``; a resumed run (same megarl
run id) continues the same tracker runs (wandb ``id=..., resume="allow"``, mlflow the same run
id), a fresh start or a forced resume (a new megarl run id) opens new ones.  Iterations after the
checkpoint run again on resume (metrics.jsonl drops their old rows): TensorBoard drops the old
events from that step on (``purge_step``); mlflow keeps both values at that step in the metric's
history (the later one is the re-run); wandb online refuses steps below the last one it holds, so
it keeps the first values of those steps (offline, both are in the run files).  A deterministic
resume reproduces every metric but wall times, so only timings can differ.

A tracker that fails while the run trains is reported once and dropped: it never stops training.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from megarl.dotted import Registry

#: the trackers by name, each with the package it imports (``meta["package"]``, None: none) and
#: the install command printed when it is missing (``meta["install"]``); registered below their
#: classes.  ``jsonl`` has no class: :class:`~megarl.observability.metrics.MetricsWriter` writes it.
TRACKERS = Registry("tracker")
TRACKERS.add("jsonl", None, package=None, install="")

STATE_FILE = "trackers.json"


def check_loggers(cfg) -> None:
    """Start-up check (:mod:`megarl.commands.run_checks`): ``trainer.loggers`` names known trackers
    whose packages are installed (found, not imported: wandb and mlflow are imported only by a run
    that logs to them)."""
    import importlib.util

    from megarl.errors import require, require_choice

    for name in cfg.trainer.loggers:
        require_choice(name, "trainer.loggers", tuple(TRACKERS.names()))
        module, install = TRACKERS.meta(name)["package"], TRACKERS.meta(name)["install"]
        require(module is None or importlib.util.find_spec(module) is not None, "trainer.loggers",
                f"names {name!r}, but the {module} package is not installed: {install}")


@dataclass
class TrackerStart:
    """What a tracker starts from: the run's config (its resolved dict and hash too), its
    directory and id, the tracker's own run id to continue (``resume_id``, None: a new one) and
    the iteration a resume continues from (``resumed_at``, None: a fresh start)."""

    cfg: Any
    run_dir: str
    run_id: str
    config: dict
    cfg_hash: str
    resume_id: Optional[str]
    resumed_at: Optional[int]


class Tracker:
    """One backend, started by :meth:`start`.  ``log_metrics`` gets the numeric values of one
    metrics.jsonl row; ``log_table`` (trackers with ``has_tables``) one sample table; ``id``: the
    backend's own run id, continued by a resume (None: it has none)."""

    name = "tracker"
    has_tables = False
    id: Optional[str] = None

    @classmethod
    def start(cls, s: TrackerStart) -> "Tracker":
        raise NotImplementedError

    def log_metrics(self, step: int, values: Dict[str, float], wall_time: float) -> None:
        raise NotImplementedError

    def log_table(self, step: int, columns: List[str], rows: List[list]) -> None:
        pass

    def close(self) -> None:
        pass


@TRACKERS.register("tensorboard", package="tensorboard",
                   install="pip install tensorboard (a dependency of megarl: pip install -e .)")
class TensorBoardTracker(Tracker):
    name = "tensorboard"

    @classmethod
    def start(cls, s: TrackerStart) -> "TensorBoardTracker":
        return cls(s.run_dir, purge_step=s.resumed_at)

    def __init__(self, run_dir: str, purge_step: Optional[int]):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events of iterations that run again after a resume are dropped from view
        self._w = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=purge_step)

    def log_metrics(self, step, values, wall_time):
        for k, v in values.items():
            self._w.add_scalar(k, v, step)
        self._w.flush()

    def close(self):
        self._w.close()


@TRACKERS.register("wandb", package="wandb", install='pip install -e ".[wandb]"')
class WandbTracker(Tracker):
    """A wandb run named after the megarl run id, its config the resolved megarl config plus
    ``megarl_run_id`` and ``config_hash``; files under ``WANDB_DIR`` (default: the run dir)."""

    name = "wandb"
    has_tables = True

    @classmethod
    def start(cls, s: TrackerStart) -> "WandbTracker":
        return cls(s.cfg.trainer.wandb, s.run_dir, s.run_id, s.config, s.cfg_hash, s.resume_id)

    def __init__(self, settings, run_dir: str, run_id: str, config: dict, cfg_hash: str, resume_id: Optional[str]):
        import wandb

        self._wandb = wandb
        self.run = wandb.init(
            project=settings.project, entity=settings.entity, group=settings.group, tags=list(settings.tags) or None,
            mode=settings.mode, name=run_id, id=resume_id or _wandb_id(run_id), resume="allow",
            dir=os.environ.get("WANDB_DIR") or run_dir,
            config={**config, "megarl_run_id": run_id, "config_hash": cfg_hash},
            # the console stays ours (tqdm, plain log lines); no code or system sampling is needed
            settings=wandb.Settings(console="off", quiet=True, save_code=False, x_disable_stats=True))
        self.id = self.run.id

    def log_metrics(self, step, values, wall_time):
        # commit: the step's row is written now (with the sample table logged before it), not
        # held open until a later step -- a crash must not lose the last iteration's metrics
        self.run.log(values, step=step, commit=True)

    def log_table(self, step, columns, rows):
        self.run.log({"samples": self._wandb.Table(columns=columns, data=rows)}, step=step, commit=False)

    def close(self):
        self.run.finish()


@TRACKERS.register("mlflow", package="mlflow", install='pip install -e ".[mlflow]"')
class MlflowTracker(Tracker):
    """An mlflow run (tags ``megarl.run_id``, ``megarl.config_hash``; the flattened config as
    params, the whole ``config.yaml`` as an artifact); sample tables as JSON artifacts
    ``samples/iter_<k>.json``.  The default store is a file store in ``<run_dir>/mlruns``."""

    name = "mlflow"
    has_tables = True

    @classmethod
    def start(cls, s: TrackerStart) -> "MlflowTracker":
        return cls(s.cfg.trainer.mlflow, s.run_dir, s.run_id, s.cfg.recipe, s.config, s.cfg_hash, s.resume_id)
    _BATCH = 100  # mlflow's log_batch takes at most 100 params and 1000 metrics per call

    def __init__(self, settings, run_dir: str, run_id: str, recipe: str, config: dict, cfg_hash: str,
                 resume_id: Optional[str]):
        self.tracking_uri = settings.tracking_uri or "file:" + os.path.abspath(os.path.join(run_dir, "mlruns"))
        if self.tracking_uri.startswith("file:") or "://" not in self.tracking_uri:
            # mlflow 3 keeps its file store in maintenance mode behind this opt-in; it is the one
            # store that needs neither a server nor SQLAlchemy (mlflow-skinny has none)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param, RunStatus, RunTag
        from mlflow.tracking import MlflowClient

        self._Param, self._RunTag = Param, RunTag
        self.client = MlflowClient(self.tracking_uri)
        tags = {"megarl.run_id": run_id, "megarl.config_hash": cfg_hash, "megarl.recipe": recipe}
        if resume_id is not None:
            self.id = resume_id
            self.client.update_run(self.id, status=RunStatus.to_string(RunStatus.RUNNING))
            logged = set(self.client.get_run(self.id).data.params)
        else:
            name = settings.experiment or recipe
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
            self.id = self.client.create_run(exp_id, run_name=run_id).info.run_id
            logged = set()
        # params cannot change once logged: a resumed run adds only new keys (the config.yaml
        # artifact, replaced below, is the whole config of the latest start)
        params = [Param(k, v) for k, v in _flatten(config).items() if k not in logged]
        for i in range(0, len(params), self._BATCH):
            self.client.log_batch(self.id, params=params[i:i + self._BATCH])
        self.client.log_batch(self.id, tags=[RunTag(k, v) for k, v in tags.items()])
        cfg_file = os.path.join(run_dir, "config.yaml")
        if os.path.isfile(cfg_file):
            self.client.log_artifact(self.id, cfg_file)

    def log_metrics(self, step, values, wall_time):
        from mlflow.entities import Metric

        ms = int(wall_time * 1000)
        metrics = [Metric(mlflow_key(k), float(v), ms, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.id, metrics=metrics[i:i + 1000])

    def log_table(self, step, columns, rows):
        self.client.log_dict(self.id, {"columns": columns, "data": rows}, f"samples/iter_{step:06d}.json")

    def close(self):
        self.client.set_terminated(self.id, "FINISHED")


def mlflow_key(key: str) -> str:
    """mlflow metric names allow letters, digits and ``_-. /``; anything else (a plug-in reward's
    ``pkg.mod:fn`` in a per-scorer metric) becomes ``_``."""
    return re.sub(r"[^\w\-. /]", "_", key)


def _wandb_id(run_id: str) -> str:
    """wandb ids may not contain ``/\\#?%:``; the id also gets a time suffix, so a fresh start in
    the same run dir (not a resume) opens a new wandb run."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", run_id)[:100] + time.strftime("-%Y%m%d%H%M%S")


def _flatten(d: dict, prefix: str = "") -> Dict[str, str]:
    """Dotted keys -> values as text, cut to mlflow's 500-character limit for param values."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            s = json.dumps(v) if not isinstance(v, str) else v
            out[key[:250]] = s if len(s) <= 500 else s[:497] + "..."
    return out


def _read_state(run_dir: str) -> dict:
    path = os.path.join(run_dir, STATE_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def open_trackers(cfg, run_dir: str, run_id: str, resumed_at: Optional[int]) -> List[Tracker]:
    """The trackers ``cfg.trainer.loggers`` names but jsonl (which MetricsWriter writes itself),
    opened on rank 0.  ``resumed_at``: the iteration a resume continues from (None: a fresh
    start); the tracker runs of ``<run_dir>/trackers.json`` are continued only on a resume of the
    same megarl run id."""
    from megarl.config.loading import config_hash, to_dict

    names = [n for n in cfg.trainer.loggers if n != "jsonl"]
    if not names:
        return []
    state = _read_state(run_dir)
    resume = resumed_at is not None and state.get("run_id") == run_id
    config, h = to_dict(cfg), config_hash(cfg)
    out: List[Tracker] = []
    for name in names:
        prev = state.get(name, {}).get("id") if resume else None
        try:
            out.append(TRACKERS.get(name).start(TrackerStart(cfg, run_dir, run_id, config, h, prev, resumed_at)))
        except Exception as e:  # a start-up failure (no login, unreachable server): say which tracker
            from megarl.errors import MegarlError

            for t in out:
                t.close()
            raise MegarlError(f"trainer.loggers: starting the {name} tracker failed: {type(e).__name__}: {e}") from None
    ids = {t.name: {"id": t.id} for t in out if t.id is not None}
    if ids:
        tmp = os.path.join(run_dir, STATE_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"run_id": run_id, **ids}, f, indent=1)
        os.replace(tmp, os.path.join(run_dir, STATE_FILE))
    return out


def call_guarded(trackers: List[Tracker], method: str, *args) -> None:
    """Call ``method`` on every tracker; one that raises is reported once and removed from the
    list (the metrics are in metrics.jsonl regardless)."""
    for t in list(trackers):
        if method == "log_table" and not t.has_tables:
            continue
        try:
            getattr(t, method)(*args)
        except Exception as e:  # a tracker never stops training
            print(f"warning: the {t.name} tracker failed ({type(e).__name__}: {e}); it is off for the rest "
                  "of this run (metrics.jsonl has every metric)", file=sys.stderr, flush=True)
            trackers.remove(t)

"""The built-in trackers, each through its own library, imported when the run starts.

Each behaves as Accelerate 1.16's tracker of the same name: the same constructor arguments (what
``init_kwargs[name]`` holds), the same calls into the library, the same treatment of each value type.
Where Accelerate drops a value it cannot log, these warn that they did, and tensors (and numpy
scalars) are logged as numbers by every tracker that takes only numbers.

Building one whose package is not installed raises an ``ImportError`` naming the package.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import time
from typing import Any

from mixprec.tracking.base import (
    GeneralTracker,
    missing_package,
    on_main_process,
    package_installed,
    plain_values,
    warn_dropped,
)

__all__ = ["AimTracker", "ClearMLTracker", "CometMLTracker", "DVCLiveTracker", "MLflowTracker",
           "SwanLabTracker", "TensorBoardTracker", "TrackioTracker", "WandBTracker", "BUILTIN_TRACKERS"]


class _LibraryTracker(GeneralTracker):
    """A tracker backed by one installed library: ``module``, installed by ``pip install <pip_name>``."""

    module: str = ""
    pip_name: str = ""
    distributions: tuple[str, ...] = ()

    @classmethod
    def installed(cls) -> bool:
        """Whether this tracker's library is installed here (what ``log_with="all"`` picks)."""
        return package_installed(cls.module, cls.distributions or (cls.pip_name,))

    def __init__(self) -> None:
        super().__init__()
        if not self.installed():
            raise missing_package(self.name, self.pip_name)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))


class TensorBoardTracker(_LibraryTracker):
    """TensorBoard, through ``torch.utils.tensorboard.SummaryWriter`` (``tensorboardX`` where only it is installed).

    Runs log to ``<logging_dir>/<run_name>``: numbers with ``add_scalar``, strings with ``add_text``, dicts of
    numbers with ``add_scalars``. The config goes to ``add_hparams`` (a sub-run named by the time) and to
    ``<logging_dir>/<run_name>/<time>/hparams.yml``.

    Args:
        run_name: the project name given to ``init_trackers``.
        logging_dir: the Accelerator's logging directory.
        **kwargs: passed to ``SummaryWriter`` (e.g. ``flush_secs``).
    """

    name = "tensorboard"
    requires_logging_directory = True
    module, pip_name = "tensorboard", "tensorboard"

    @classmethod
    def installed(cls) -> bool:
        """Whether ``tensorboard`` (or ``tensorboardX``) is installed here."""
        return package_installed("tensorboard", ("tensorboard",)) or package_installed("tensorboardX", ("tensorboardX",))

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str], **kwargs: Any):
        super().__init__()
        self.run_name = run_name
        self.logging_dir_param = logging_dir
        self.logging_dir = os.path.join(logging_dir, run_name)
        self.init_kwargs = kwargs
        self.writer: Any = None

    @on_main_process
    def start(self) -> None:
        """Open the ``SummaryWriter`` on ``<logging_dir>/<run_name>``."""
        try:
            from torch.utils import tensorboard
        except ModuleNotFoundError:
            import tensorboardX as tensorboard
        self.writer = tensorboard.SummaryWriter(self.logging_dir, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        """The ``SummaryWriter``."""
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """``add_hparams(values, metric_dict={})``, then ``values`` as YAML in ``<time>/hparams.yml`` (as JSON,
        which YAML reads, where PyYAML is not installed)."""
        self.writer.add_hparams(values, metric_dict={})
        self.writer.flush()
        folder = os.path.join(self.logging_dir, str(time.time()))
        os.makedirs(folder, exist_ok=True)
        try:
            import yaml
        except ImportError:
            yaml = None
        with open(os.path.join(folder, "hparams.yml"), "w") as f:
            if yaml is not None:
                yaml.dump(values, f)
            else:
                json.dump(values, f, indent=2, default=str)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Numbers with ``add_scalar``, strings with ``add_text``, dicts with ``add_scalars``; ``kwargs`` go to
        each of those calls."""
        for key, value in plain_values(values).items():
            if _is_number(value):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
            else:
                warn_dropped("TensorBoard", key, value, "numbers, strings and dicts of numbers")
        self.writer.flush()

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """``add_images(key, images, global_step=step, **kwargs)`` for each batch of images in ``values``."""
        for key, images in values.items():
            self.writer.add_images(key, images, global_step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        """Close the writer."""
        self.writer.close()


class WandBTracker(_LibraryTracker):
    """Weights & Biases: ``wandb.init(project=run_name, **kwargs)``; ``log`` is ``run.log(values, step=step)``.

    ``WANDB_MODE=offline`` keeps the run on disk (``dir=...`` in ``init_kwargs`` or ``WANDB_DIR`` says where).

    Args:
        run_name: the project name given to ``init_trackers``.
        **kwargs: passed to ``wandb.init`` (``name``, ``tags``, ``dir``, ``mode``, ...).
    """

    name = "wandb"
    requires_logging_directory = False
    main_process_only = False
    module, pip_name = "wandb", "wandb"

    def __init__(self, run_name: str, **kwargs: Any):
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run: Any = None

    @on_main_process
    def start(self) -> None:
        """``wandb.init(project=run_name, **kwargs)``."""
        import wandb

        self.run = wandb.init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        """The ``wandb`` run."""
        return self.run

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """``run.config.update(values, allow_val_change=True)``."""
        self.run.config.update(values, allow_val_change=True)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """``run.log(values, step=step, **kwargs)``: wandb takes numbers, strings, tensors and its media types."""
        self.run.log(values, step=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Each list of images (numpy arrays or PIL images) in ``values`` as a list of ``wandb.Image``."""
        import wandb

        for key, images in values.items():
            self.log({key: [wandb.Image(image) for image in images]}, step=step, **kwargs)

    @on_main_process
    def log_table(self, table_name: str, columns: list[str] | None = None, data: list[list[Any]] | None = None,
                  dataframe: Any = None, step: int | None = None, **kwargs: Any) -> None:
        """A ``wandb.Table`` of ``columns`` and ``data`` (or of ``dataframe``) logged as ``table_name``."""
        import wandb

        self.log({table_name: wandb.Table(columns=columns, data=data, dataframe=dataframe)}, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        """``run.finish()``."""
        self.run.finish()


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


class CometMLTracker(_LibraryTracker):
    """Comet: ``comet_ml.start(project_name=run_name, **kwargs)`` (``comet_ml.Experiment`` before comet_ml 3.41).

    Numbers go to ``log_metric``, strings to ``log_other``, dicts to ``log_metrics``; the config to
    ``log_parameters``. The API key comes from Comet's own config file or environment.

    Args:
        run_name: the project name given to ``init_trackers``.
        **kwargs: passed to ``comet_ml.start``.
    """

    name = "comet_ml"
    requires_logging_directory = False
    module, pip_name, distributions = "comet_ml", "comet-ml", ("comet_ml", "comet-ml")

    def __init__(self, run_name: str, **kwargs: Any):
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.writer: Any = None

    @on_main_process
    def start(self) -> None:
        """Start (or, with the ``experiment_key`` of ``kwargs``, resume) the experiment."""
        import comet_ml

        if _version(comet_ml.__version__) >= (3, 41, 0):
            self.writer = comet_ml.start(project_name=self.run_name, **self.init_kwargs)
        else:
            self.writer = comet_ml.Experiment(project_name=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        """The Comet experiment."""
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """``experiment.log_parameters(values)``."""
        self.writer.log_parameters(values)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """``set_step(step)``, then numbers with ``log_metric``, strings with ``log_other``, dicts with
        ``log_metrics``."""
        if step is not None:
            self.writer.set_step(step)
        for key, value in plain_values(values).items():
            if _is_number(value):
                self.writer.log_metric(key, value, step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.log_other(key, value, **kwargs)
            elif isinstance(value, dict):
                self.writer.log_metrics(value, step=step, **kwargs)
            else:
                warn_dropped("Comet", key, value, "numbers, strings and dicts of numbers")

    @on_main_process
    def finish(self) -> None:
        """``experiment.end()``."""
        self.writer.end()


class AimTracker(_LibraryTracker):
    """Aim (before 4.0): an ``aim.Run`` in the repository at the logging directory, named ``run_name``.

    ``log`` tracks each value with ``run.track(value, name=key, step=step)``; the config is ``run["hparams"]``.

    Args:
        run_name: the project name given to ``init_trackers``.
        logging_dir: the Aim repository (the Accelerator's logging directory).
        **kwargs: passed to ``aim.Run``.
    """

    name = "aim"
    requires_logging_directory = True
    module, pip_name = "aim", "aim<4"

    @classmethod
    def installed(cls) -> bool:
        """Whether ``aim`` before 4.0 is installed (Accelerate, too, takes only those)."""
        if not package_installed("aim", ("aim",)):
            return False
        import importlib.metadata

        return _version(importlib.metadata.version("aim")) < (4,)

    def __init__(self, run_name: str, logging_dir: str | os.PathLike[str] | None = ".", **kwargs: Any):
        super().__init__()
        self.run_name = run_name
        self.aim_repo_path = logging_dir
        self.init_kwargs = kwargs
        self.writer: Any = None

    @on_main_process
    def start(self) -> None:
        """``aim.Run(repo=logging_dir, **kwargs)``, named ``run_name``."""
        from aim import Run

        self.writer = Run(repo=self.aim_repo_path, **self.init_kwargs)
        self.writer.name = self.run_name

    @property
    def tracker(self) -> Any:
        """The ``aim.Run``."""
        return self.writer

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """``run["hparams"] = values``."""
        self.writer["hparams"] = values

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """``run.track(value, name=key, step=step, **kwargs)`` for each value."""
        for key, value in values.items():
            self.writer.track(value, name=key, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        """``run.close()``."""
        self.writer.close()


class MLflowTracker(_LibraryTracker):
    """MLflow: a run in the experiment ``experiment_name`` (created where missing), on MLflow's tracking URI.

    ``MLFLOW_EXPERIMENT_NAME``, ``MLFLOW_RUN_ID``, ``MLFLOW_TAGS`` (JSON) and ``MLFLOW_NESTED_RUN`` take
    precedence over the arguments, as in Accelerate. ``log`` logs the numbers with ``mlflow.log_metrics``
    (other values are warned about and left out); the config goes to ``mlflow.log_params`` in batches MLflow
    takes, leaving out (with a warning) values longer than MLflow's limit.

    Args:
        experiment_name: the experiment (the project name given to ``init_trackers``).
        logging_dir: the artifact location of an experiment this creates (MLflow's default if ``None``).
        run_id: resume this run instead of starting one.
        tags: the run's (and a new experiment's) tags, a dict or its JSON.
        nested_run: start the run nested in the active one.
        run_name: the new run's name.
        description: the run's description.
    """

    name = "mlflow"
    requires_logging_directory = False
    module, pip_name, distributions = "mlflow", "mlflow", ("mlflow", "mlflow-skinny")

    def __init__(self, experiment_name: str | None = None, logging_dir: str | os.PathLike[str] | None = None,
                 run_id: str | None = None, tags: dict[str, Any] | str | None = None, nested_run: bool | str = False,
                 run_name: str | None = None, description: str | None = None):
        super().__init__()
        tags = os.environ.get("MLFLOW_TAGS", tags)
        nested_run = os.environ.get("MLFLOW_NESTED_RUN", nested_run)
        if isinstance(nested_run, str):
            if nested_run.strip().lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off", "y", "n", "t", "f"):
                raise ValueError(f"MLFLOW_NESTED_RUN={nested_run!r} is not a boolean: set it to true or false.")
            nested_run = nested_run.strip().lower() in ("1", "true", "yes", "on", "y", "t")
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name)
        self.logging_dir = logging_dir
        self.run_id = os.environ.get("MLFLOW_RUN_ID", run_id)
        self.tags = json.loads(tags) if isinstance(tags, str) else tags
        self.nested_run = nested_run
        self.run_name = run_name
        self.description = description
        self.active_run: Any = None

    @on_main_process
    def start(self) -> None:
        """Find or create the experiment, then ``mlflow.start_run`` in it."""
        import mlflow

        experiment = None if self.experiment_name is None else mlflow.get_experiment_by_name(self.experiment_name)
        if experiment is not None or self.experiment_name is None:  # no name: MLflow's default experiment
            experiment_id = None if experiment is None else experiment.experiment_id
        else:
            experiment_id = mlflow.create_experiment(name=self.experiment_name, tags=self.tags,
                                                     artifact_location=None if self.logging_dir is None
                                                     else str(self.logging_dir))
        self.active_run = mlflow.start_run(run_id=self.run_id, experiment_id=experiment_id, run_name=self.run_name,
                                           nested=self.nested_run, tags=self.tags, description=self.description)

    @property
    def tracker(self) -> Any:
        """The active ``mlflow.ActiveRun``."""
        return self.active_run

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """``mlflow.log_params`` in batches of MLflow's maximum, leaving out values longer than it takes."""
        import mlflow
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        kept = []
        for key, value in values.items():
            if len(str(value)) > MAX_PARAM_VAL_LENGTH:
                warn_dropped("MLflow", key, value, f"parameters of at most {MAX_PARAM_VAL_LENGTH} characters")
            else:
                kept.append((key, value))
        for i in range(0, len(kept), MAX_PARAMS_TAGS_PER_BATCH):
            mlflow.log_params(dict(kept[i:i + MAX_PARAMS_TAGS_PER_BATCH]))

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """``mlflow.log_metrics`` of the numbers in ``values`` (tensors as numbers) at ``step``."""
        import mlflow

        metrics = {}
        for key, value in plain_values(values).items():
            if _is_number(value):
                metrics[key] = value
            else:
                warn_dropped("MLflow", key, value, "only numbers as metrics")
        mlflow.log_metrics(metrics, step=step, **kwargs)

    @on_main_process
    def log_figure(self, figure: Any, artifact_file: str, **save_kwargs: Any) -> None:
        """``mlflow.log_figure(figure=figure, artifact_file=artifact_file, **save_kwargs)``."""
        import mlflow

        mlflow.log_figure(figure=figure, artifact_file=artifact_file, **save_kwargs)

    @on_main_process
    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        """Every file under ``local_dir`` as artifacts of the run (under ``artifact_path``)."""
        import mlflow

        mlflow.log_artifacts(local_dir=local_dir, artifact_path=artifact_path)

    @on_main_process
    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        """The file ``local_path`` as an artifact of the run (under ``artifact_path``)."""
        import mlflow

        mlflow.log_artifact(local_path=local_path, artifact_path=artifact_path)

    @on_main_process
    def finish(self) -> None:
        """``mlflow.end_run()``."""
        import mlflow

        mlflow.end_run()


class ClearMLTracker(_LibraryTracker):
    """ClearML: the task already running, else ``Task.init(project_name=..., task_name=...)``.

    ``log`` reports each number: with a step as a scalar whose title is the key and series ``train`` (a key
    ``eval_x``, ``test_x`` or ``train_x`` becomes title ``x`` in that series), without a step as a single value.
    ``CLEARML_PROJECT`` and ``CLEARML_TASK`` take precedence over ``run_name``.

    Args:
        run_name: the project and task name (the project name given to ``init_trackers``).
        **kwargs: passed to ``clearml.Task.init``.
    """

    name = "clearml"
    requires_logging_directory = False
    module, pip_name = "clearml", "clearml"

    def __init__(self, run_name: str | None = None, **kwargs: Any):
        super().__init__()
        self.user_provided_run_name = run_name
        self.init_kwargs = kwargs
        self.initialized_externally = False
        self.task: Any = None

    @on_main_process
    def start(self) -> None:
        """Take ``Task.current_task()`` where one runs (it is then not closed here), else ``Task.init``."""
        from clearml import Task

        current = Task.current_task()
        if current:
            self.initialized_externally = True
            self.task = current
            return
        arguments = dict(self.init_kwargs)
        arguments.setdefault("project_name", os.environ.get("CLEARML_PROJECT", self.user_provided_run_name))
        arguments.setdefault("task_name", os.environ.get("CLEARML_TASK", self.user_provided_run_name))
        self.task = Task.init(**arguments)

    @property
    def tracker(self) -> Any:
        """The ClearML task."""
        return self.task

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> Any:
        """``task.connect_configuration(values)`` (returned)."""
        return self.task.connect_configuration(values)

    @staticmethod
    def title_series(key: str) -> tuple[str, str]:
        """``(title, series)`` of a key: ``eval_loss`` -> ``("loss", "eval")``, ``loss`` -> ``("loss", "train")``."""
        for prefix in ("eval", "test", "train"):
            if key.startswith(prefix + "_"):
                return key[len(prefix) + 1:], prefix
        return key, "train"

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Each number with ``report_scalar`` (with a step) or ``report_single_value`` (without)."""
        logger = self.task.get_logger()
        for key, value in plain_values(values).items():
            if not _is_number(value):
                warn_dropped("ClearML", key, value, "only numbers")
            elif step is None:
                logger.report_single_value(name=key, value=value, **kwargs)
            else:
                title, series = self.title_series(key)
                logger.report_scalar(title=title, series=series, value=value, iteration=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        """Close the task, unless it was started outside (then it stays open)."""
        if self.task and not self.initialized_externally:
            self.task.close()


class DVCLiveTracker(_LibraryTracker):
    """DVCLive: a ``dvclive.Live`` (the one given, else ``Live(**kwargs)``).

    ``log`` sets ``live.step`` to ``step`` when given, logs each value DVCLive takes as a metric with
    ``log_metric`` (warning about the others), then ``next_step()``.

    Args:
        run_name: not used (DVCLive has no run name; ``dir`` in ``kwargs`` says where).
        live: a ``Live`` to log to instead of a new one.
        **kwargs: passed to ``dvclive.Live``.
    """

    name = "dvclive"
    requires_logging_directory = False
    module, pip_name = "dvclive", "dvclive"

    def __init__(self, run_name: str | None = None, live: Any = None, **kwargs: Any):
        super().__init__()
        self.live = live
        self.init_kwargs = kwargs

    @on_main_process
    def start(self) -> None:
        """``dvclive.Live(**kwargs)`` unless one was given."""
        from dvclive import Live

        if self.live is None:
            self.live = Live(**self.init_kwargs)

    @property
    def tracker(self) -> Any:
        """The ``dvclive.Live``."""
        return self.live

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """``live.log_params(values)``."""
        self.live.log_params(values)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Each loggable value with ``live.log_metric``, then ``live.next_step()``."""
        from dvclive.plots import Metric

        if step is not None:
            self.live.step = step
        for key, value in plain_values(values).items():
            if Metric.could_log(value):
                self.live.log_metric(key, value, **kwargs)
            else:
                warn_dropped("DVCLive", key, value, "only numbers as metrics")
        self.live.next_step()

    @on_main_process
    def finish(self) -> None:
        """``live.end()``."""
        self.live.end()


class _ProjectRunTracker(_LibraryTracker):
    """A library whose module offers ``init(project=...)`` returning a run with ``log`` and
    ``finish``, and ``config.update`` (SwanLab's and trackio's, both shaped after wandb's).

    Args:
        run_name: the project name given to ``init_trackers``.
        **kwargs: passed to ``<module>.init``.
    """

    requires_logging_directory = False
    main_process_only = False

    def __init__(self, run_name: str, **kwargs: Any):
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run: Any = None

    @on_main_process
    def start(self) -> None:
        """``<module>.init(project=run_name, **kwargs)``."""
        self.run = importlib.import_module(self.module).init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self) -> Any:
        """The library's run."""
        return self.run

    @on_main_process
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """``<module>.config.update(values)``.

        Accelerate passes ``allow_val_change=True`` too, as to wandb; but trackio's config is a plain dict and
        SwanLab's ``Config.update`` takes keyword arguments as items, so both would store an
        ``allow_val_change: True`` entry in the run's config. It is left out here."""
        importlib.import_module(self.module).config.update(values)

    @on_main_process
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """``run.log(values, step=step, **kwargs)``."""
        self.run.log(values, step=step, **kwargs)

    @on_main_process
    def finish(self) -> None:
        """``run.finish()``."""
        self.run.finish()


class SwanLabTracker(_ProjectRunTracker):
    """SwanLab: ``swanlab.init(project=run_name, **kwargs)``; ``log`` is ``run.log(values, step=step)``."""

    name = "swanlab"
    module, pip_name = "swanlab", "swanlab"


class TrackioTracker(_ProjectRunTracker):
    """trackio: ``trackio.init(project=run_name, **kwargs)``; ``log`` is ``run.log(values, step=step)``."""

    name = "trackio"
    module, pip_name = "trackio", "trackio"


#: name -> class of the built-in trackers, in the order ``log_with="all"`` starts them (Accelerate's).
BUILTIN_TRACKERS: dict[str, type[GeneralTracker]] = {
    cls.name: cls for cls in (TensorBoardTracker, WandBTracker, CometMLTracker, AimTracker, MLflowTracker,
                              ClearMLTracker, DVCLiveTracker, SwanLabTracker, TrackioTracker)
}

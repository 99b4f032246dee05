"""mixprec.tracking: log_with resolved as Accelerate resolves it, and trackers that really log.

Every tracker runs for real, offline, under tmp_path, where its package is installed (the ``tracking``
extra installs them all), and what it wrote is read back with its library's own reader or from its files
on disk: TensorBoard, MLflow and wandb through ``Trackers``; Comet, ClearML, Aim, DVCLive, trackio and
SwanLab through ``Accelerator(log_with=...)``. A tracker whose package is missing is skipped with the
reason. Besides, a stand-in module put in ``sys.modules`` records the calls each of those six makes, to
check they are the ones Accelerate makes, with or without the package.
"""

from __future__ import annotations

import enum
import json
import struct
import sys
import time
import warnings
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mixprec import Accelerator
from mixprec.tracking import (
    AimTracker,
    ClearMLTracker,
    CometMLTracker,
    DVCLiveTracker,
    GeneralTracker,
    LoggerType,
    SwanLabTracker,
    TensorBoardTracker,
    Trackers,
    TrackioTracker,
    WandBTracker,
    register_tracker_class,
    registry,
    resolve_log_with,
    start_trackers,
)

ALL_NAMES = ["aim", "tensorboard", "wandb", "trackio", "comet_ml", "mlflow", "clearml", "dvclive", "swanlab"]


class Recorder(GeneralTracker):
    """A user's tracker: records every call."""

    name = "recorder"
    requires_logging_directory = False

    def __init__(self, main_process_only: bool = True):
        super().__init__()
        self.main_process_only = main_process_only
        self.calls: list[tuple[Any, ...]] = []

    @property
    def tracker(self) -> list[tuple[Any, ...]]:
        return self.calls

    def start(self) -> None:
        self.calls.append(("start",))

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.calls.append(("config", dict(values)))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.calls.append(("log", dict(values), step, kwargs))

    def finish(self) -> None:
        self.calls.append(("finish",))


# ---------------------------------------------------------------- log_with, as Accelerate reads it


def test_logger_type_has_accelerates_members_and_values():
    pytest.importorskip("accelerate", reason="compares with Accelerate: pip install accelerate")
    from accelerate.utils import LoggerType as AccelerateLoggerType

    assert {m.name: m.value for m in LoggerType} == {m.name: m.value for m in AccelerateLoggerType}
    assert LoggerType.list() == AccelerateLoggerType.list()
    assert str(LoggerType.COMETML) == "comet_ml" and LoggerType.WANDB == "wandb"
    assert "wandb" in LoggerType and "wandbb" not in LoggerType


def test_a_wrong_name_is_a_value_error_listing_the_valid_ones(tmp_path):
    for wrong in ("tensorbord", ["tensorboard", "TensorBoard"], 3):
        with pytest.raises(ValueError) as caught:
            resolve_log_with(wrong, tmp_path)
        assert all(repr(name) in str(caught.value) for name in ALL_NAMES), str(caught.value)


def test_names_enums_and_instances_resolve_once_each_in_order(tmp_path):
    pytest.importorskip("accelerate", reason="compares with Accelerate: pip install accelerate")
    from accelerate.utils import LoggerType as AccelerateLoggerType

    mine = Recorder()
    assert resolve_log_with(None, tmp_path) == []
    assert resolve_log_with("tensorboard", tmp_path) == ["tensorboard"]
    assert resolve_log_with([LoggerType.TENSORBOARD, AccelerateLoggerType.TENSORBOARD, mine, "tensorboard"],
                            tmp_path) == ["tensorboard", mine]
    assert resolve_log_with((mine,)) == [mine]


def test_all_is_every_installed_tracker_as_accelerates_filter_trackers_finds_them(tmp_path):
    pytest.importorskip("accelerate", reason="compares with Accelerate: pip install accelerate")
    from accelerate.tracking import filter_trackers

    mine = Recorder()
    theirs = [str(t) for t in filter_trackers(["all"], str(tmp_path))]
    assert resolve_log_with("all", tmp_path) == theirs
    assert resolve_log_with([mine, "all"], tmp_path) == [mine, *theirs]


def test_a_tracker_writing_to_a_folder_without_one_is_an_error_stating_the_fix():
    if not TensorBoardTracker.installed():
        pytest.skip("tensorboard is not installed: pip install tensorboard")
    for log_with in ("tensorboard", "all", ["aim"]):
        if log_with == ["aim"] and not AimTracker.installed():
            continue
        with pytest.raises(ValueError, match=r"project_dir=\.\.\."):
            resolve_log_with(log_with, None)
    assert resolve_log_with(Recorder(), None)[0].name == "recorder"  # a tracker instance needs no folder


@pytest.mark.parametrize("name, cls, pip_name", [("wandb", WandBTracker, "pip install wandb"),
                                                ("comet_ml", CometMLTracker, "pip install comet-ml"),
                                                ("aim", AimTracker, "pip install 'aim<4'")])
def test_a_missing_package_is_an_import_error_naming_it(monkeypatch, tmp_path, name, cls, pip_name):
    if not TensorBoardTracker.installed():
        pytest.skip("tensorboard is not installed: pip install tensorboard")
    monkeypatch.setitem(sys.modules, cls.module, None)  # `import <module>` now fails, as where it is not installed
    assert not cls.installed()
    with pytest.raises(ImportError, match=pip_name) as caught:
        resolve_log_with(["tensorboard", name], tmp_path)
    assert f"leave {name!r} out of log_with" in str(caught.value)
    with pytest.raises(ImportError, match=pip_name):
        cls("proj", tmp_path) if cls.requires_logging_directory else cls("proj")
    assert name not in resolve_log_with("all", tmp_path)


def test_all_with_nothing_installed_warns(monkeypatch):
    for cls in registry.BUILTIN_TRACKERS.values():
        monkeypatch.setattr(cls, "installed", classmethod(lambda cls: False))
    with pytest.warns(UserWarning, match="found no tracker installed"):
        assert resolve_log_with("all") == []


# ---------------------------------------------------------------- a user's tracker, and the holder


def test_a_users_tracker_receives_start_config_log_and_finish():
    mine, other = Recorder(), Recorder()
    other.name = "other"
    trackers = Trackers([mine, other])
    trackers.init("proj", config={"lr": 0.1}, init_kwargs={"recorder": {}}, is_main_process=True)
    trackers.log({"loss": 1.5}, step=3, log_kwargs={"recorder": {"commit": True}})
    assert trackers.get("recorder") is mine and trackers.get("recorder", unwrap=True) is mine.calls
    with pytest.raises(ValueError, match="those running: 'recorder', 'other'"):
        trackers.get("wandb")
    trackers.finish()
    assert mine.calls == [("start",), ("config", {"lr": 0.1}), ("log", {"loss": 1.5}, 3, {"commit": True}),
                          ("finish",)]
    assert other.calls[2] == ("log", {"loss": 1.5}, 3, {})  # log_kwargs go by tracker name
    assert list(trackers) == [mine, other] and len(trackers) == 2


def test_without_config_nothing_is_stored_and_a_tracker_lacking_attributes_says_which():
    mine = Recorder()
    assert start_trackers([mine], "proj", None, is_main_process=True) == [mine]
    assert mine.calls == [("start",)]

    class Incomplete(GeneralTracker):
        name = "incomplete"

    with pytest.raises(NotImplementedError, match="`requires_logging_directory`, `tracker`"):
        Incomplete()


def test_a_tracker_written_for_accelerate_works_as_it_is():
    pytest.importorskip("accelerate", reason="a tracker written for Accelerate: pip install accelerate")
    from accelerate.tracking import GeneralTracker as AccelerateTracker

    class Theirs(AccelerateTracker):
        name, requires_logging_directory = "theirs", False

        def __init__(self):
            super().__init__()
            self.logged = []

        @property
        def tracker(self):
            return self.logged

        def log(self, values, step=None, **kwargs):
            self.logged.append((values, step))

    theirs = Theirs()
    trackers = Trackers(theirs)
    trackers.init("proj", config={"lr": 0.1}, is_main_process=True)
    trackers.log({"loss": 1.0}, step=1)
    trackers.finish()
    assert theirs.logged == [({"loss": 1.0}, 1)]


def test_the_other_processes_start_no_tracker_and_log_nothing(tmp_path):
    if not TensorBoardTracker.installed():
        pytest.skip("tensorboard is not installed: pip install tensorboard")
    mine, everywhere = Recorder(), Recorder(main_process_only=False)
    everywhere.name = "everywhere"
    trackers = Trackers(["tensorboard", mine, everywhere], logging_dir=tmp_path)
    trackers.init("proj", config={"lr": 0.1}, is_main_process=False)
    trackers.log({"loss": 1.5}, step=1)
    blank = trackers.get("tensorboard")
    blank.log({"loss": 1.5}, step=1)
    trackers.finish()
    assert trackers.trackers == [] and type(blank) is GeneralTracker
    assert mine.calls == [] and everywhere.calls == []  # Accelerate's init_trackers and log run on rank 0 only
    assert list(tmp_path.iterdir()) == []


def test_a_main_process_only_tracker_called_directly_on_another_rank_does_nothing(monkeypatch, tmp_path):
    if not TensorBoardTracker.installed():
        pytest.skip("tensorboard is not installed: pip install tensorboard")
    monkeypatch.setenv("RANK", "1")
    tracker = TensorBoardTracker("proj", tmp_path)
    tracker.start()
    tracker.store_init_configuration({"lr": 0.1})
    tracker.log({"loss": 1.5}, step=1)
    tracker.finish()
    assert tracker.tracker is None and list(tmp_path.iterdir()) == []


def test_a_registered_class_is_a_name_built_with_the_logging_dir(monkeypatch, tmp_path):
    monkeypatch.setattr(registry, "TRACKER_CLASSES", dict(registry.TRACKER_CLASSES))

    class Folder(Recorder):
        name, requires_logging_directory = "folder", True

        def __init__(self, project_name, logging_dir, suffix=""):
            super().__init__()
            self.where = Path(logging_dir) / (project_name + suffix)

    register_tracker_class(Folder)
    with pytest.raises(ValueError, match="project_dir"):
        resolve_log_with("folder")
    trackers = Trackers("folder", logging_dir=tmp_path)
    trackers.init("proj", init_kwargs={"folder": {"suffix": "-1"}}, is_main_process=True)
    assert trackers.get("folder").where == tmp_path / "proj-1"
    with pytest.warns(UserWarning, match="replaces"):
        register_tracker_class(Folder)
    with pytest.raises(ValueError, match="subclass of mixprec.tracking.GeneralTracker"):
        register_tracker_class(object)


def test_init_kwargs_of_no_tracker_warn_and_of_the_wrong_type_fail():
    with pytest.warns(UserWarning, match=r"init_kwargs\['wandbb'\] names no tracker"):
        start_trackers([Recorder()], "proj", None, None, {"wandbb": {}}, is_main_process=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a known tracker that is not in use is fine (scripts pass several)
        start_trackers([Recorder()], "proj", None, None, {"wandb": {"tags": ["a"]}}, is_main_process=True)
    with pytest.raises(TypeError, match=r"init_kwargs\['recorder'\] is a list"):
        start_trackers([Recorder()], "proj", None, None, {"recorder": []}, is_main_process=True)


def test_a_tracker_failing_to_start_finishes_those_started():
    first = Recorder()

    class Failing(Recorder):
        name = "failing"

        def start(self):
            raise RuntimeError("no server")

    with pytest.raises(RuntimeError, match="no server"):
        start_trackers([first, Failing()], "proj", None, {"lr": 0.1}, is_main_process=True)
    assert first.calls == [("start",), ("finish",)]


def test_finish_closes_every_tracker_even_after_one_fails():
    class Failing(Recorder):
        name = "failing"

        def finish(self):
            raise OSError("disk full")

    last = Recorder()
    trackers = Trackers([Failing(), last])
    trackers.init("proj", is_main_process=True)
    with pytest.raises(OSError, match="disk full"):
        trackers.finish()
    assert last.calls[-1] == ("finish",)


# ---------------------------------------------------------------- TensorBoard, MLflow, wandb: for real


def test_tensorboard_logs_scalars_text_dicts_and_the_config_read_back(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = Trackers("tensorboard", logging_dir=tmp_path)
    config = {"lr": 0.01, "optimizer": "adamw", "amp": True}
    trackers.init("proj", config=config, init_kwargs={"tensorboard": {"flush_secs": 5}}, is_main_process=True)
    trackers.log({"loss": 1.5, "note": "warming up", "lr": {"group0": 0.5, "group1": 0.25},
                  "grad_norm": torch.tensor(0.75, dtype=torch.bfloat16)}, step=3)
    trackers.log({"loss": 1.25}, step=4)
    trackers.get("tensorboard").log_images({"samples": torch.zeros(2, 3, 4, 4)}, step=4)
    writer = trackers.get("tensorboard", unwrap=True)
    trackers.finish()

    run = tmp_path / "proj"
    assert writer.log_dir == str(run)
    events = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("loss")] == [(3, 1.5), (4, 1.25)]
    assert [(s.step, s.value) for s in events.Scalars("grad_norm")] == [(3, 0.75)]
    text = events.Tensors("note/text_summary")[0]
    assert text.step == 3 and text.tensor_proto.string_val == [b"warming up"]
    assert [(i.step, i.width, i.height) for i in events.Images("samples")] == [(4, 8, 4)]
    for group, value in (("group0", 0.5), ("group1", 0.25)):  # add_scalars: one sub-run per key
        sub = EventAccumulator(str(run / f"lr_{group}"))
        sub.Reload()
        assert [(s.step, s.value) for s in sub.Scalars("lr")] == [(3, value)]

    (yml,) = run.glob("*/hparams.yml")
    assert _yaml(yml) == config
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    (hparams,) = [f for f in run.glob("*/events.out.tfevents.*") if not f.parent.name.startswith("lr_")]
    start = [v for event in EventFileLoader(str(hparams)).Load() for v in event.summary.value
             if v.tag == "_hparams_/session_start_info"]
    got = plugin_data_pb2.HParamsPluginData.FromString(start[0].metadata.plugin_data.content).session_start_info.hparams
    assert {k: getattr(v, v.WhichOneof("kind")) for k, v in got.items()} == {"lr": 0.01, "optimizer": "adamw", "amp": True}


def _yaml(path: Path) -> Any:
    try:
        import yaml
    except ImportError:
        return json.loads(path.read_text())
    return yaml.safe_load(path.read_text())


def test_tensorboard_warns_of_a_value_it_does_not_log(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed: pip install tensorboard")
    trackers = Trackers("tensorboard", logging_dir=tmp_path)
    trackers.init("proj", is_main_process=True)
    with pytest.warns(UserWarning, match="did not log 'weights': its value is a list"):
        trackers.log({"weights": torch.ones(3)}, step=1)
    trackers.finish()


def test_mlflow_logs_metrics_and_params_to_a_local_file_store_read_back(monkeypatch, tmp_path):
    pytest.importorskip("mlflow", reason="mlflow is not installed: pip install mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses the file store without it
    for name in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "MLFLOW_TAGS", "MLFLOW_NESTED_RUN"):
        monkeypatch.delenv(name, raising=False)
    notes = tmp_path / "notes.txt"
    notes.write_text("fp16 run")

    trackers = Trackers("mlflow")
    with pytest.warns(UserWarning, match="did not log 'huge'"):
        trackers.init("proj", config={"lr": 0.1, "optimizer": "adamw", "huge": "x" * 10_000},
                      init_kwargs={"mlflow": {"run_name": "first", "tags": {"team": "mp"}}}, is_main_process=True)
    with pytest.warns(UserWarning, match="did not log 'note'"):
        trackers.log({"loss": 1.5, "note": "text"}, step=3)
    trackers.log({"loss": torch.tensor(1.25)}, step=4)
    trackers.get("mlflow").log_artifact(str(notes))
    run_id = trackers.get("mlflow", unwrap=True).info.run_id
    trackers.finish()

    client = MlflowClient()
    run = client.get_run(run_id)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(3, 1.5), (4, 1.25)]
    assert run.data.params == {"lr": "0.1", "optimizer": "adamw"}
    assert run.data.tags["team"] == "mp" and run.info.run_name == "first" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    assert [a.path for a in client.list_artifacts(run_id)] == ["notes.txt"]

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")  # the environment wins, as in Accelerate
    trackers = Trackers("mlflow")
    trackers.init("proj", is_main_process=True)
    experiment_id = trackers.get("mlflow", unwrap=True).info.experiment_id
    trackers.finish()
    assert client.get_experiment(experiment_id).name == "from-env"


def _wandb_records(path: Path) -> list[Any]:
    """The records of a wandb run file: a 7-byte header, then LevelDB-log blocks of 32 KiB whose records
    (checksum, length, type: 1 full, 2 first, 3 middle, 4 last) hold serialized ``Record`` protos."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending, records = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def wandb_offline(monkeypatch, tmp_path) -> None:
    """wandb offline, every file it writes under ``tmp_path`` (the working folder too)."""
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_DIR": tmp_path,
           "WANDB_CONFIG_DIR": tmp_path / "config", "WANDB_CACHE_DIR": tmp_path / "cache",
           "WANDB_DATA_DIR": tmp_path / "data", "WANDB_DISABLE_GIT": "true"}
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.chdir(tmp_path)


def test_wandb_offline_run_holds_the_config_and_the_logged_steps(monkeypatch, tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed: pip install wandb")
    wandb_offline(monkeypatch, tmp_path)

    trackers = Trackers(LoggerType.WANDB)
    trackers.init("proj", config={"lr": 0.1, "optimizer": "adamw"},
                  init_kwargs={"wandb": {"dir": str(tmp_path), "name": "first", "tags": ["mixprec"]}},
                  is_main_process=True)
    run = trackers.get("wandb", unwrap=True)
    assert (run.project, run.name, list(run.tags)) == ("proj", "first", ["mixprec"])
    trackers.log({"loss": 1.5, "note": "warming up"}, step=3)
    trackers.log({"loss": 1.25}, step=4)
    trackers.finish()

    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    # wandb's service process writes the file on its own: finish() can return before it is all
    # there (a header alone, seen on a loaded machine); its last record is the run's exit
    deadline = time.monotonic() + 60
    while True:
        try:
            records = _wandb_records(run_file)
        except Exception:  # noqa: BLE001 - a record half written: read again
            records = []
        if records and records[-1].WhichOneof("record_type") == "exit" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    updates = [u for r in records if r.WhichOneof("record_type") == "config" for u in r.config.update]
    config = {u.key: json.loads(u.value_json) for u in updates}
    assert config["lr"] == 0.1 and config["optimizer"] == "adamw"
    history = [{i.nested_key[0] if i.nested_key else i.key: json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["loss"]) for h in history] == [(3, 1.5), (4, 1.25)]
    assert history[0]["note"] == "warming up"
    assert (run_file.parent / "files").is_dir()


# ---------------------------------------------------------------- Comet, ClearML, Aim, DVCLive, trackio, SwanLab: for real

CONFIG = {"lr": 0.1, "optimizer": "adamw", "amp": True}


def _setenv(monkeypatch, env: dict[str, Any], unset: tuple[str, ...] = ()) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    for key in unset:
        monkeypatch.delenv(key, raising=False)


def test_comet_offline_archive_holds_the_parameters_and_the_logged_steps(monkeypatch, tmp_path):
    # Comet's switches, set before comet_ml is imported (auto-logging would install an import hook):
    # an offline experiment, written as a zip to the offline directory; no config file; pytest's arguments,
    # the environment and the source not logged.
    _setenv(monkeypatch, {"COMET_START_ONLINE": "false", "COMET_OFFLINE_DIRECTORY": tmp_path / "comet",
                          "COMET_CONFIG": tmp_path / "none.comet.config", "COMET_DISABLE_AUTO_LOGGING": "1",
                          "COMET_AUTO_LOG_ENV_DETAILS": "false", "COMET_AUTO_LOG_ENV_HOST": "false",
                          "COMET_AUTO_LOG_GIT_METADATA": "false", "COMET_AUTO_LOG_GIT_PATCH": "false",
                          "COMET_AUTO_LOG_CODE": "false", "COMET_AUTO_LOG_CLI_ARGUMENTS": "false",
                          "COMET_LOGGING_CONSOLE": "error"},
            unset=("COMET_API_KEY", "COMET_EXPERIMENT_KEY", "COMET_PROJECT_NAME", "COMET_WORKSPACE"))
    comet_ml = pytest.importorskip("comet_ml", reason="comet_ml is not installed: pip install comet-ml")
    monkeypatch.chdir(tmp_path)  # Comet also reads ./.comet.config and ./.env

    accelerator = Accelerator(cpu=True, log_with="comet_ml", project_dir=tmp_path)
    accelerator.init_trackers("proj", config=CONFIG)
    accelerator.log({"loss": 1.5, "note": "warming up", "lr": {"group0": 0.5}}, step=3)
    accelerator.log({"loss": torch.tensor(1.25)}, step=4)
    experiment = accelerator.get_tracker("comet_ml", unwrap=True)
    assert isinstance(experiment, comet_ml.OfflineExperiment)
    key = experiment.get_key()
    accelerator.end_training()

    (archive,) = (tmp_path / "comet").glob(f"{key}-*.zip")
    with zipfile.ZipFile(archive) as z:
        meta = json.loads(z.read("experiment.json"))
        messages = [json.loads(line) for line in z.read("messages.json").decode().splitlines()]
    assert meta["project_name"] == "proj" and meta["offline_id"] == key
    params = {m["payload"]["param"]["paramName"]: m["payload"]["param"]["paramValue"] for m in messages
              if m["type"] == "parameter_msg" and m["payload"]["param"]["step"] is None}
    assert params == CONFIG
    metrics = [(m["payload"]["metric"]["metricName"], m["payload"]["metric"]["step"], m["payload"]["metric"]["metricValue"])
               for m in messages if m["type"] == "metric_msg"]
    assert [m for m in metrics if m[0] in ("loss", "group0")] == [("loss", 3, 1.5), ("group0", 3, 0.5), ("loss", 4, 1.25)]
    others = {m["payload"]["key"]: m["payload"]["value"] for m in messages if m["type"] == "log_other"}
    assert others["note"] == "warming up"


@pytest.mark.filterwarnings("ignore:.*deprecated.*:DeprecationWarning")  # ClearML's HOCON parser on pyparsing 3
def test_clearml_offline_session_holds_the_configuration_and_the_reported_scalars(monkeypatch, tmp_path):
    # ClearML's config file (in tmp_path, not ~/clearml.conf): report from a thread, not a forked process.
    (tmp_path / "clearml.conf").write_text("sdk.development.report_use_subprocess: false\n")
    _setenv(monkeypatch, {"CLEARML_OFFLINE_MODE": "1", "CLEARML_CONFIG_FILE": tmp_path / "clearml.conf",
                          "CLEARML_CACHE_DIR": tmp_path / "cache", "HOME": tmp_path / "home"},  # ~/.clearml/.session.json
            unset=("CLEARML_PROJECT", "CLEARML_TASK", "CLEARML_TASK_ID", "CLEARML_API_HOST"))
    pytest.importorskip("clearml", reason="clearml is not installed: pip install clearml")
    from clearml import Task
    from clearml.backend_api.session.session import Session
    from clearml.backend_interface.base import InterfaceBase
    from clearml.utilities.config import text_to_config_dict

    for cls in (Session, InterfaceBase):  # Task.set_offline sets these; they are put back after the test
        monkeypatch.setattr(cls, "_offline_mode", cls._offline_mode)
    Task.set_offline(True)
    monkeypatch.chdir(tmp_path)

    accelerator = Accelerator(cpu=True, log_with="clearml", project_dir=tmp_path)
    quiet = {"auto_connect_frameworks": False, "auto_connect_arg_parser": False, "auto_connect_streams": False,
             "auto_resource_monitoring": False}
    accelerator.init_trackers("proj", config=CONFIG, init_kwargs={"clearml": {"task_name": "first", **quiet}})
    accelerator.log({"loss": 1.5, "eval_loss": 2.0}, step=3)
    with pytest.warns(UserWarning, match="did not log 'note'"):
        accelerator.log({"loss": torch.tensor(1.25), "note": "text"}, step=4)
    accelerator.log({"accuracy": 0.5})  # without a step: a single value
    task = accelerator.get_tracker("clearml", unwrap=True)
    folder = Path(task.get_offline_mode_folder())
    accelerator.end_training()

    assert folder.parent == tmp_path / "cache" / "offline" and folder.with_suffix(".zip").is_file()
    saved = json.loads((folder / "task.json").read_text())
    assert (saved["project_name"], saved["name"]) == ("proj", "first")
    assert text_to_config_dict(saved["configuration"]["General"]["value"]) == CONFIG
    events = [e for line in (folder / "metrics.jsonl").read_text().splitlines() for e in json.loads(line)]
    scalars = [(e["metric"], e["variant"], e["iter"], e["value"]) for e in events if e["type"] == "training_stats_scalar"]
    assert scalars[:3] == [("loss", "train", 3, 1.5), ("loss", "eval", 3, 2.0), ("loss", "train", 4, 1.25)]
    assert [(metric, variant, value) for metric, variant, _, value in scalars[3:]] == [("Summary", "accuracy", 0.5)]


def test_aim_repository_holds_the_run_its_hparams_and_the_tracked_steps(tmp_path):
    pytest.importorskip("aim", reason="aim is not installed: pip install 'aim<4'")
    if not AimTracker.installed():
        pytest.skip("the aim installed is 4.0 or later; the tracker (as Accelerate's) takes aim<4")
    from aim import Repo
    from aim.sdk.index_manager import RepoIndexManager

    accelerator = Accelerator(cpu=True, log_with="aim", project_dir=tmp_path)  # the repository: <project_dir>/.aim
    accelerator.init_trackers("proj", config=CONFIG, init_kwargs={"aim": {
        "experiment": "mixprec", "system_tracking_interval": None, "capture_terminal_logs": False}})
    accelerator.log({"loss": 1.5, "grad_norm": torch.tensor(0.75)}, step=3)
    accelerator.log({"loss": 1.25}, step=4)
    run_hash = accelerator.get_tracker("aim", unwrap=True).hash
    accelerator.end_training()

    repo = Repo(str(tmp_path))
    RepoIndexManager.get_index_manager(repo).index(run_hash)  # what `aim storage reindex` does; `aim up` does it live
    run = repo.get_run(run_hash)
    assert (run.name, run.experiment, run.active) == ("proj", "mixprec", False)
    assert run["hparams"] == CONFIG
    history = {}
    for metric in run.metrics():
        steps, (values, _epochs, _times) = metric.data.numpy()
        history[metric.name] = list(zip(steps.tolist(), values.tolist()))
    assert history == {"loss": [(3, 1.5), (4, 1.25)], "grad_norm": [(3, 0.75)]}


def test_dvclive_writes_params_the_metric_history_and_the_latest_values(monkeypatch, tmp_path):
    _setenv(monkeypatch, {"DVC_STUDIO_OFFLINE": "true", "DVC_NO_ANALYTICS": "1"},
            unset=("DVC_STUDIO_TOKEN", "DVC_ROOT", "DVC_EXP_NAME", "DVC_EXP_BASELINE_REV", "DVCLIVE_RESUME"))
    pytest.importorskip("dvclive", reason="dvclive is not installed: pip install dvclive")
    from dvclive.serialize import load_yaml
    from dvclive.utils import parse_json, read_history

    monkeypatch.chdir(tmp_path)  # no Git repository: no DVC experiment; dvc.yaml is written here
    accelerator = Accelerator(cpu=True, log_with="dvclive", project_dir=tmp_path)
    accelerator.init_trackers("proj", config=CONFIG, init_kwargs={"dvclive": {
        "dir": str(tmp_path / "dvclive"), "save_dvc_exp": False}})
    with pytest.warns(UserWarning, match="did not log 'lr'"):
        accelerator.log({"loss": 1.5, "note": "warming up", "lr": {"group0": 0.5}}, step=3)
    accelerator.log({"loss": torch.tensor(1.25)}, step=4)
    live = accelerator.get_tracker("dvclive", unwrap=True)
    accelerator.end_training()

    assert load_yaml(live.params_file) == CONFIG
    assert read_history(live, "loss") == ([3, 4], [1.5, 1.25])
    assert parse_json(live.metrics_file) == {"step": 4, "loss": 1.25, "note": "warming up"}


def test_trackio_local_database_holds_the_config_and_the_logged_steps(monkeypatch, tmp_path):
    # trackio reads TRACKIO_DIR (else $HF_HOME/trackio) once, when imported; no Space, no server: local only.
    _setenv(monkeypatch, {"TRACKIO_DIR": tmp_path / "trackio"},
            unset=("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "TRACKIO_DATASET_ID", "TRACKIO_REGISTRY_BUCKET_ID"))
    trackio = pytest.importorskip("trackio", reason="trackio is not installed: pip install trackio")
    # Imported before (by another test of this worker), its modules hold their own copies of the folder
    # they read from the environment: point each at tmp_path (monkeypatch restores them).
    for name, module in list(sys.modules.items()):
        if (name == "trackio" or name.startswith("trackio.")) and hasattr(module, "TRACKIO_DIR"):
            monkeypatch.setattr(module, "TRACKIO_DIR", tmp_path / "trackio")
    from trackio.sqlite_storage import SQLiteStorage

    accelerator = Accelerator(cpu=True, log_with="trackio", project_dir=tmp_path)
    accelerator.init_trackers("proj", config=CONFIG, init_kwargs={"trackio": {"name": "first", "auto_log_cpu": False}})
    accelerator.log({"loss": 1.5, "note": "warming up"}, step=3)
    accelerator.log({"loss": 1.25}, step=4)
    accelerator.end_training()

    (run,) = trackio.Api().runs("proj")
    assert run.name == "first"
    assert {k: v for k, v in run.config.items() if not k.startswith("_")} == CONFIG  # no `allow_val_change` entry
    logs = SQLiteStorage.get_logs("proj", "first")
    assert [(entry["step"], entry["loss"]) for entry in logs] == [(3, 1.5), (4, 1.25)]
    assert logs[0]["note"] == "warming up"
    assert sorted(p.name for p in (tmp_path / "trackio").glob("*.db")) == ["proj.db"]


def test_swanlab_offline_run_holds_the_config_and_the_logged_steps(monkeypatch, tmp_path):
    # SwanLab's settings from the environment: offline (kept on disk for `swanlab sync`), its run folder and
    # its user folder (else ~/.swanlab) in tmp_path.
    _setenv(monkeypatch, {"SWANLAB_MODE": "offline", "SWANLAB_LOG_DIR": tmp_path / "swanlog",
                          "SWANLAB_ROOT": tmp_path / "swanlab-root"},
            unset=("SWANLAB_API_KEY", "SWANLAB_PROJECT", "SWANLAB_PROJ_NAME", "SWANLAB_EXP_NAME", "SWANLAB_RUN_ID",
                   "SWANLAB_RESUME", "SWANLAB_WORKSPACE"))
    pytest.importorskip("swanlab", reason="swanlab is not installed: pip install swanlab")
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    monkeypatch.chdir(tmp_path)
    accelerator = Accelerator(cpu=True, log_with="swanlab", project_dir=tmp_path)
    accelerator.init_trackers("proj", config=CONFIG, init_kwargs={"swanlab": {"name": "first"}})
    accelerator.log({"loss": 1.5, "grad_norm": 0.75}, step=3)
    accelerator.log({"loss": 1.25}, step=4)
    accelerator.end_training()

    (folder,) = (tmp_path / "swanlog").glob("run-*")
    assert {k: v["value"] for k, v in _yaml(folder / "files" / "config.yaml").items()} == CONFIG
    (run_file,) = folder.glob("run-*.swanlab")
    reader = DataStoreReader()
    reader.open(run_file)
    records = [Record.FromString(data) for data in reader]
    reader.close()
    kinds = [r.WhichOneof("record_type") for r in records]
    start = records[kinds.index("start")].start
    assert (start.project, start.name) == ("proj", "first")
    scalars = [(r.scalar.key, r.scalar.step, r.scalar.value.number) for r in records if r.WhichOneof("record_type") == "scalar"]
    assert scalars == [("loss", 3, 1.5), ("grad_norm", 3, 0.75), ("loss", 4, 1.25)]
    assert kinds[-1] == "finish"


# ---------------------------------------------------------------- the same six against stand-ins: their calls


class Fake:
    """Stands in for a library: each call, attribute set and item set becomes a line of text in ``calls``.
    A call returns a ``Fake`` named after it, so ``comet_ml.start()`` is ``Fake("comet_ml.start()")``."""

    def __init__(self, calls: list[str], path: str, **fixed: Any):
        object.__setattr__(self, "calls", calls)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "fixed", fixed)

    def __getattr__(self, name: str) -> Any:
        if name in self.fixed:
            return self.fixed[name]
        if name.startswith("__"):
            raise AttributeError(name)
        return Fake(self.calls, f"{self.path}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Fake:
        shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in sorted(kwargs.items())]
        self.calls.append(f"{self.path}({', '.join(shown)})")
        return Fake(self.calls, f"{self.path}()")

    def __setattr__(self, name: str, value: Any) -> None:
        self.calls.append(f"{self.path}.{name} = {value!r}")

    def __setitem__(self, key: str, value: Any) -> None:
        self.calls.append(f"{self.path}[{key!r}] = {value!r}")

    def __repr__(self) -> str:
        return self.path


def _stand_in(monkeypatch, cls: type, calls: list[str], modules: dict[str, dict[str, Any]]) -> None:
    for name, fixed in modules.items():
        monkeypatch.setitem(sys.modules, name, Fake(calls, name, **fixed))
    monkeypatch.setattr(cls, "installed", classmethod(lambda cls: True))


VALUES = {"loss": 1.5, "note": "hi", "lr": {"g0": 0.5}}


def _clearml(calls: list[str]) -> dict[str, dict[str, Any]]:
    return {"clearml": {"Task": Fake(calls, "clearml.Task", current_task=lambda: None)}}


def _dvclive(calls: list[str]) -> dict[str, dict[str, Any]]:
    def could_log(value: Any) -> bool:  # dvclive's Metric.could_log, numpy scalars aside
        return isinstance(value, (int, float, str))

    return {"dvclive": {}, "dvclive.plots": {"Metric": SimpleNamespace(could_log=could_log)}}


# name -> (class, the stand-in modules' fixed attributes, the calls expected)
STAND_INS: dict[str, tuple[type, Any, list[str]]] = {
    "comet_ml": (CometMLTracker, lambda calls: {"comet_ml": {"__version__": "3.49.1"}}, [
        "comet_ml.start(project_name='proj', workspace='w')",
        "comet_ml.start().log_parameters({'lr': 0.1})",
        "comet_ml.start().set_step(3)",
        "comet_ml.start().log_metric('loss', 1.5, step=3)",
        "comet_ml.start().log_other('note', 'hi')",
        "comet_ml.start().log_metrics({'g0': 0.5}, step=3)",
        "comet_ml.start().end()"]),
    "aim": (AimTracker, lambda calls: {"aim": {}}, [
        "aim.Run(repo=<dir>, workspace='w')",
        "aim.Run().name = 'proj'",
        "aim.Run()['hparams'] = {'lr': 0.1}",
        "aim.Run().track(1.5, name='loss', step=3)",
        "aim.Run().track('hi', name='note', step=3)",
        "aim.Run().track({'g0': 0.5}, name='lr', step=3)",
        "aim.Run().close()"]),
    "clearml": (ClearMLTracker, _clearml, [
        "clearml.Task.init(project_name='proj', task_name='proj', workspace='w')",
        "clearml.Task.init().connect_configuration({'lr': 0.1})",
        "clearml.Task.init().get_logger()",
        "clearml.Task.init().get_logger().report_scalar(iteration=3, series='train', title='loss', value=1.5)",
        "clearml.Task.init().close()"]),
    "dvclive": (DVCLiveTracker, _dvclive, [
        "dvclive.Live(workspace='w')",
        "dvclive.Live().log_params({'lr': 0.1})",
        "dvclive.Live().step = 3",
        "dvclive.Live().log_metric('loss', 1.5)",
        "dvclive.Live().log_metric('note', 'hi')",
        "dvclive.Live().next_step()",
        "dvclive.Live().end()"]),
    "swanlab": (SwanLabTracker, lambda calls: {"swanlab": {}}, [
        "swanlab.init(project='proj', workspace='w')",
        "swanlab.config.update({'lr': 0.1})",
        "swanlab.init().log(<values>, step=3)",
        "swanlab.init().finish()"]),
    "trackio": (TrackioTracker, lambda calls: {"trackio": {}}, [
        "trackio.init(project='proj', workspace='w')",
        "trackio.config.update({'lr': 0.1})",
        "trackio.init().log(<values>, step=3)",
        "trackio.init().finish()"]),
}


@pytest.mark.parametrize("name", sorted(STAND_INS))
def test_the_other_trackers_make_accelerates_calls_to_a_stand_in(monkeypatch, tmp_path, name):
    cls, modules, expected = STAND_INS[name]
    calls: list[str] = []
    _stand_in(monkeypatch, cls, calls, modules(calls))
    monkeypatch.delenv("CLEARML_PROJECT", raising=False)
    monkeypatch.delenv("CLEARML_TASK", raising=False)
    trackers = Trackers(name, logging_dir=tmp_path)
    trackers.init("proj", config={"lr": 0.1}, init_kwargs={name: {"workspace": "w"}}, is_main_process=True)
    with warnings.catch_warnings(record=True) as dropped:
        warnings.simplefilter("always")
        trackers.log(VALUES, step=3)
    trackers.finish()
    expected = [line.replace("<dir>", repr(tmp_path)).replace("<values>", repr(VALUES)) for line in expected]
    assert calls == expected
    if name in ("clearml", "dvclive"):  # the dict is warned about, and by ClearML (numbers only) the string
        assert sorted(str(w.message).split("'")[1] for w in dropped) == ["lr", "note"][:2 if name == "clearml" else 1]


def test_comet_before_3_41_builds_an_experiment_and_clearml_keeps_a_task_started_outside(monkeypatch):
    calls: list[str] = []
    _stand_in(monkeypatch, CometMLTracker, calls, {"comet_ml": {"__version__": "3.40.2"}})
    tracker = CometMLTracker("proj")
    tracker.start()
    assert calls == ["comet_ml.Experiment(project_name='proj')"]

    calls.clear()
    outside = Fake(calls, "task")
    _stand_in(monkeypatch, ClearMLTracker, calls, {"clearml": {"Task": SimpleNamespace(current_task=lambda: outside)}})
    tracker = ClearMLTracker("proj")
    tracker.start()
    tracker.log({"eval_loss": 0.5})
    tracker.finish()
    assert tracker.tracker is outside
    assert calls == ["task.get_logger()", "task.get_logger().report_single_value(name='eval_loss', value=0.5)"]
    assert ClearMLTracker.title_series("eval_loss") == ("loss", "eval")


def test_every_builtin_tracker_is_a_log_with_name_and_a_logger_type():
    assert sorted(registry.BUILTIN_TRACKERS) == sorted(n for n in LoggerType.list() if n != "all")
    for name, cls in registry.BUILTIN_TRACKERS.items():
        assert cls.name == name and isinstance(cls.main_process_only, bool)
    assert isinstance(LoggerType.ALL, enum.Enum) and LoggerType("all") is LoggerType.ALL

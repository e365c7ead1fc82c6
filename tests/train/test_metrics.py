"""The training metrics: metrics.jsonl and the TensorBoard and MLflow backends, read back with each library's
own reader (a resumed run keeps only what came before its checkpoint), and wandb offline."""

import json

import pytest

from headstart.core.settings import parse
from headstart.train.metrics import MetricsLog
from headstart.train.train_config import TrainConfig


def config(out_dir, **metrics):
    out_dir.mkdir(exist_ok=True)  # train() has made it (config.yaml) before the log opens
    raw = {
        "target": {"path": "unused"},
        "data": {"source": "unused.jsonl", "format": "gsm8k", "max_length": 8},
        "head": {"type": "eagle3"},
        "train": {"out_dir": str(out_dir)},
        "metrics": metrics,
    }
    return parse(raw, TrainConfig)


def train_record(step, loss):
    return {"step": step, "split": "train", "lr": 0.01, "loss": loss, "tokens": 64, "tokens_per_s": 100.0}


def heldout_record(step, acc):
    return {"step": step, "split": "heldout", "loss": 1.0 - acc, "acc": acc, "predicted_tau": 1 + acc}


def measured_record(step, tau):
    return {"step": step, "split": "measured", "tau": tau, "acc_depth_1": tau - 1, "prompts": 2, "new_tokens": 16}


def run(cfg, start, records):
    log = MetricsLog(cfg, rank=0, start=start, total=4)
    for record in records:
        log.log(record)
    log.close()


def killed_then_resumed(cfg):
    """Steps 1-4 and evaluations at 2 and 4, then a run resumed from the checkpoint at step 2 redoing 3-4."""
    first = [train_record(1, 4.0), train_record(2, 3.0), heldout_record(2, 0.25), measured_record(2, 1.3)]
    run(cfg, 0, [*first, train_record(3, 2.5)])
    run(cfg, 2, [train_record(3, 2.0), train_record(4, 1.5), heldout_record(4, 0.5), measured_record(4, 1.6)])


def test_defaults_write_metrics_jsonl_only(tmp_path):
    cfg = config(tmp_path / "run")
    assert cfg.metrics.model_dump() == {"tensorboard": False, "mlflow": False, "mlflow_experiment": "headstart"}
    killed_then_resumed(cfg)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.jsonl"]  # no other backend
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"], r["loss"]) for r in lines if "loss" in r] == [
        (1, "train", 4.0),
        (2, "train", 3.0),
        (2, "heldout", 0.75),
        (3, "train", 2.0),
        (4, "train", 1.5),
        (4, "heldout", 0.5),
    ]
    measured = [(r["step"], r["tau"]) for r in lines if r["split"] == "measured"]
    assert measured == [(2, 1.3), (4, 1.6)]


def test_a_line_cut_short_by_a_kill_is_dropped_on_resume(tmp_path):
    cfg = config(tmp_path / "run")
    run(cfg, 0, [train_record(1, 4.0), train_record(2, 3.0)])
    path = tmp_path / "run" / "metrics.jsonl"
    path.write_text(path.read_text() + json.dumps(train_record(3, 2.5))[:30])  # killed while writing step 3
    run(cfg, 2, [train_record(3, 2.0)])
    assert [json.loads(line)["loss"] for line in path.read_text().splitlines()] == [4.0, 3.0, 2.0]


def test_tensorboard_holds_the_numbers_and_hides_the_redone_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    killed_then_resumed(config(tmp_path / "run", tensorboard=True))
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    measured = {"measured/tau", "measured/acc_depth_1", "measured/prompts", "measured/new_tokens"}
    held_out = {"heldout/loss", "heldout/acc", "heldout/predicted_tau"}
    assert {"loss", "lr", "tokens", "tokens_per_s"} | held_out | measured == set(scalars)
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("measured/tau")] == [(2, 1.3), (4, 1.6)]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 4.0), (2, 3.0), (3, 2.0), (4, 1.5)]
    assert [(e.step, e.value) for e in events.Scalars("heldout/acc")] == [(2, 0.25), (4, 0.5)]


def test_mlflow_holds_the_numbers_in_a_local_store(tmp_path):
    from mlflow.tracking import MlflowClient

    killed_then_resumed(config(tmp_path / "run", mlflow=True, mlflow_experiment="demo"))
    client = MlflowClient(tracking_uri=(tmp_path / "run" / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("demo")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    assert [r.info.run_name for r in runs] == ["run", "run (resumed at step 2)"]
    assert all(r.info.status == "FINISHED" for r in runs)

    def history(run, name):
        return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]

    first, resumed = runs
    assert history(first, "loss") == [(1, 4.0), (2, 3.0), (3, 2.5)]
    assert history(first, "heldout/acc") == [(2, 0.25)]
    assert history(resumed, "loss") == [(3, 2.0), (4, 1.5)]
    assert history(resumed, "heldout/predicted_tau") == [(4, 1.5)]
    assert history(first, "measured/tau") == [(2, 1.3)] and history(resumed, "measured/tau") == [(4, 1.6)]
    assert history(resumed, "tokens") == [(3, 64.0), (4, 64.0)]


def test_wandb_offline_runs_in_the_out_dir(tmp_path, monkeypatch):
    # wandb 0.31 has no reader for an offline run's file (only `wandb sync` to a server): the run itself is checked.
    from headstart.train.metrics import Wandb

    monkeypatch.setenv("WANDB_MODE", "offline")  # the tests' default (conftest) is disabled
    cfg = config(tmp_path / "run")
    cfg.wandb = cfg.wandb.model_copy(update={"mode": "offline", "name": "demo"})
    backend = Wandb(cfg, tmp_path / "run")
    backend.log({"loss": 3.0, "lr": 0.01}, step=1)
    backend.log({"loss": 2.0, "heldout/acc": 0.5}, step=2)
    run = backend.run
    assert run.offline and run.name == "demo" and run.project == "headstart"
    assert run.config["train"]["out_dir"] == str(tmp_path / "run")
    backend.close()
    (log,) = (tmp_path / "run" / "wandb").glob(f"offline-run-*/run-{run.id}.wandb")
    assert log.stat().st_size > 0


@pytest.mark.parametrize("section", [{"tensorbord": True}, {"mlflow": "yes"}])
def test_a_bad_metrics_section_is_refused(tmp_path, section):
    from headstart.core.config_files import ConfigError

    with pytest.raises(ConfigError, match=r"metrics\."):
        config(tmp_path / "run", **section)


def test_the_acceptance_plot_draws_predicted_and_measured_tau(tmp_path):
    from PIL import Image

    from headstart.train.metrics import plot_acceptance

    killed_then_resumed(config(tmp_path / "run"))
    plot = tmp_path / "run" / "acceptance.png"
    plot_acceptance(tmp_path / "run" / "metrics.jsonl", plot)
    assert Image.open(plot).size == (1210, 440)  # two panels, 11 x 4 inches at 110 dpi

"""Rank 0's record of a run: ``metrics.jsonl`` always; TensorBoard, MLflow and wandb when the config turns
them on (``metrics.tensorboard``, ``metrics.mlflow``, ``wandb.mode``); a tqdm bar on the terminal.

Each held-out evaluation also predicts the head's acceptance length from its per-position top-1
accuracies (``predicted_tau``, docs/TRAINING.md), so a run shows early whether it is worth finishing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from headstart.core.acceptance import chain_tau as predicted_tau  # the chain model on held-out top-1 accuracies
from headstart.core.io import atomic_path, atomic_write_text, read_jsonl
from headstart.core.settings import as_dict
from headstart.heads import HeadConfig
from headstart.train.train_config import TrainConfig


def heldout_top1(record: dict[str, Any]) -> list[float]:
    """Per-position top-1 accuracies a_1..a_k of a held-out record: ``acc`` (EAGLE-1/2, one position) or
    ``acc_0``..``acc_{k-1}`` (EAGLE-3's test-time-training steps, Medusa's heads), in position order."""
    if "acc" in record:
        return [record["acc"]]
    positions = sorted(int(key.removeprefix("acc_")) for key in record if key.startswith("acc_"))
    return [record[f"acc_{j}"] for j in positions]


def training_summary(record: dict[str, Any]) -> dict[str, Any]:
    """What a head's ``config.json`` keeps of its last held-out evaluation (key ``training``)."""
    top1 = heldout_top1(record)
    return {"heldout_top1": top1, "predicted_tau": predicted_tau(top1), "step": record["step"]}


def measured_by_depth(record: dict[str, Any]) -> list[float]:
    """The acceptance rate at each draft depth of a measured record (``acc_depth_1``..), in depth order."""
    depths = sorted(int(key.removeprefix("acc_depth_")) for key in record if key.startswith("acc_depth_"))
    return [record[f"acc_depth_{d}"] for d in depths]


def measured_summary(record: dict[str, Any]) -> dict[str, Any]:
    """What a head's ``config.json`` keeps of its last measured acceptance (beside ``training_summary``)."""
    return {
        "measured_tau": record["tau"],
        "measured_acceptance_by_depth": measured_by_depth(record),
        "measured_prompts": record["prompts"],
        "measured_new_tokens": record["new_tokens"],
    }


ACCEPTANCE_PLOT = "acceptance.png"
RENDERING = {"chat": "chats in the target's chat template", "raw": "raw text, as a completion API feeds the target"}


def head_readme(config: HeadConfig, command: str | None) -> str:
    """A trained head's README.md: what it is, and the acceptance its last evaluation predicted and measured."""
    summary = config.training or {}
    lines = [
        f"# {config.type} draft head for `{config.target}`",
        "",
        f"Trained by headstart on {RENDERING[config.prompt_format or 'chat']}.",
        "",
    ]
    if "step" in summary:
        lines.append(f"At step {summary['step']}:")
        lines.append("")
    if "predicted_tau" in summary:
        top1 = ", ".join(f"{a:.3f}" for a in summary["heldout_top1"])
        lines.append(f"- predicted tau {summary['predicted_tau']:.3f} (chain model on held-out top-1 {top1})")
    if "measured_tau" in summary:
        rates = ", ".join(f"{a:.3f}" for a in summary["measured_acceptance_by_depth"])
        lines.append(
            f"- measured tau {summary['measured_tau']:.3f} (greedy chains of depth {config.trained_depth}, "
            f"{summary['measured_prompts']} prompts, {summary['measured_new_tokens']} new tokens; acceptance by "
            f"depth {rates})"
        )
    if command:
        lines += ["", "Repeat the measurement (exactly, in fp32):", "", "```", command, "```"]
    return "\n".join(lines) + "\n"


def plot_acceptance(metrics_path: Path, path: Path) -> None:
    """Predicted and measured tau over the steps, and the last measurement's acceptance by depth beside the held-out
    top-1 accuracy per position, from ``metrics.jsonl`` (a resumed run's earlier steps included)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [record for _, record in read_jsonl(metrics_path)]
    heldout = [r for r in records if r["split"] == "heldout"]
    measured = [r for r in records if r["split"] == "measured"]
    if not measured:
        return
    fig, (over_steps, by_depth) = plt.subplots(1, 2, figsize=(11, 4))
    if heldout:
        over_steps.plot([r["step"] for r in heldout], [r["predicted_tau"] for r in heldout], "o--", label="predicted")
    over_steps.plot([r["step"] for r in measured], [r["tau"] for r in measured], "o-", label="measured")
    over_steps.set(xlabel="step", ylabel="tau (tokens per target forward)", title="acceptance length")
    over_steps.legend()
    last = measured[-1]
    rates = measured_by_depth(last)
    depths = range(1, len(rates) + 1)
    by_depth.bar([d - 0.2 for d in depths], rates, width=0.4, label="measured acceptance")
    top1 = next((heldout_top1(r) for r in reversed(heldout) if r["step"] == last["step"]), None)
    if top1:
        by_depth.bar([d + 0.2 for d in range(1, len(top1) + 1)], top1, width=0.4, label="held-out top-1")
    by_depth.set(xlabel="draft depth", ylabel="rate", title=f"step {last['step']}", ylim=(0, 1))
    by_depth.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


class Backend(Protocol):
    """A metrics library beside metrics.jsonl: each record's numbers at its step, then closed once."""

    def log(self, values: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class MetricsLog:
    """One JSON line per training step and per held-out evaluation, and the same numbers to each backend
    the config turns on (rank 0 only; other ranks log nothing)."""

    def __init__(self, cfg: TrainConfig, rank: int, start: int, total: int):
        self.active = rank == 0
        self.file = None
        self.backends: list[Backend] = []
        out_dir = Path(cfg.train.out_dir)
        self.path = out_dir / "metrics.jsonl"
        if self.active:
            _drop_after(self.path, start)
            self.file = self.path.open("a")
            self.backends = open_backends(cfg, out_dir, start)
        self.bar = tqdm(total=total, initial=start, disable=not self.active, desc="train", unit="step")

    def log(self, record: dict[str, Any]) -> None:
        if self.file is None:  # not rank 0
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        values = _named_values(record)
        for backend in self.backends:
            backend.log(values, record["step"])
        if record["split"] == "train":
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
        else:
            self.bar.write(f"step {record['step']} {record['split']}: " + _brief(record))

    def close(self) -> None:
        self.bar.close()
        if self.file is not None:
            self.file.close()
        for backend in self.backends:
            backend.close()


def _named_values(record: dict[str, Any]) -> dict[str, float]:
    """A record's numbers as the backends name them: ``loss`` for a training step, ``heldout/loss`` for an
    evaluation."""
    prefix = "" if record["split"] == "train" else f"{record['split']}/"
    return {prefix + k: v for k, v in record.items() if k not in ("step", "split")}


def _brief(record: dict[str, Any]) -> str:
    return ", ".join(
        f"{k} {v}" if isinstance(v, int) else f"{k} {v:.4f}" for k, v in record.items() if k not in ("step", "split")
    )


def _drop_after(path: Path, step: int) -> None:
    """A resumed run redoes the steps after its checkpoint: forget what the killed run logged for them.

    A line cut short by the kill (the record being written) is one of those steps, and is dropped too.
    """
    if not path.is_file():
        return
    kept = [record for _, record in read_jsonl(path, on_bad_record=lambda err: None) if record["step"] <= step]
    atomic_write_text(path, "".join(json.dumps(record) + "\n" for record in kept))  # a kill here keeps the kept


def open_backends(cfg: TrainConfig, out_dir: Path, start: int) -> list[Backend]:
    """The backends the config turns on, each writing under ``out_dir`` (wandb: its ``wandb/`` folder)."""
    backends: list[Backend] = []
    if cfg.metrics.tensorboard:
        backends.append(TensorBoard(out_dir / "tensorboard", start))
    if cfg.metrics.mlflow:
        backends.append(MLflow(out_dir, cfg.metrics.mlflow_experiment, start))
    if cfg.wandb.mode != "disabled":
        backends.append(Wandb(cfg, out_dir))
    return backends


class TensorBoard:
    """Event files for ``tensorboard --logdir <out_dir>/tensorboard``, through torch's SummaryWriter."""

    def __init__(self, log_dir: Path, start: int):
        from torch.utils.tensorboard import SummaryWriter  # only when asked for: it imports tensorboard

        # TensorBoard hides the events at steps >= purge_step that earlier writers left: the steps a
        # resumed run redoes.
        self.writer = SummaryWriter(str(log_dir), purge_step=start + 1)

    def log(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class MLflow:
    """A local MLflow file store in ``<out_dir>/mlruns`` (``mlflow ui --backend-store-uri <that folder>``).

    Each launch is one run of ``experiment``; a resumed launch logs only the steps after its checkpoint.
    """

    def __init__(self, out_dir: Path, experiment: str, start: int):
        # MLflow 3 refuses its file store unless told (it would have a database server), and reports usage
        # over the network unless told not to.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.entities import Metric  # only when asked for: it is slow to import
        from mlflow.tracking import MlflowClient

        self.metric = Metric
        self.client = MlflowClient(tracking_uri=(out_dir / "mlruns").absolute().as_uri())
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        name = out_dir.name if start == 0 else f"{out_dir.name} (resumed at step {start})"
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id

    def log(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [self.metric(name, float(value), now, step) for name, value in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Wandb:
    """A wandb run in ``<out_dir>/wandb``; ``wandb.mode: offline`` never talks to the server, so it never asks
    for a login."""

    def __init__(self, cfg: TrainConfig, out_dir: Path):
        import wandb  # only when asked for: it is slow to import

        settings = cfg.wandb
        self.run = wandb.init(
            project=settings.project, name=settings.name, mode=settings.mode, dir=str(out_dir), config=as_dict(cfg)
        )

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()

"""Rank 0's record of a run: ``metrics.jsonl`` always, wandb when enabled, a tqdm bar on the terminal.

Each held-out evaluation also predicts the head's acceptance length from its per-position top-1
accuracies (``predicted_tau``, docs/TRAINING.md), so a run shows early whether it is worth finishing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tqdm import tqdm

from core.acceptance import chain_tau as predicted_tau  # the chain model on held-out top-1 accuracies
from core.io import atomic_write_text


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


class MetricsLog:
    """One JSON line per training step and per held-out evaluation (rank 0 only; other ranks log nothing)."""

    def __init__(self, cfg: dict[str, Any], rank: int, start: int, total: int):
        self.active = rank == 0
        out_dir = Path(cfg["train"]["out_dir"])
        self.file = None
        self.run = None
        if self.active:
            path = out_dir / "metrics.jsonl"
            _drop_after(path, start)
            self.file = path.open("a")
            self.run = _wandb_run(cfg, out_dir)
        self.bar = tqdm(total=total, initial=start, disable=not self.active, desc="train", unit="step")

    def log(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.run is not None:
            prefix = "" if record["split"] == "train" else f"{record['split']}/"
            values = {prefix + k: v for k, v in record.items() if k not in ("step", "split")}
            self.run.log(values, step=record["step"])
        if record["split"] == "train":
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
        else:
            self.bar.write(f"step {record['step']} held-out: " + _brief(record))

    def close(self) -> None:
        self.bar.close()
        if self.file is not None:
            self.file.close()
        if self.run is not None:
            self.run.finish()


def _brief(record: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in record.items() if k not in ("step", "split"))


def _drop_after(path: Path, step: int) -> None:
    """A resumed run redoes the steps after its checkpoint: forget what the killed run logged for them."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    atomic_write_text(path, "".join(line + "\n" for line in lines))  # a kill here must not lose the kept steps


def _wandb_run(cfg: dict[str, Any], out_dir: Path) -> Any:
    settings = cfg["wandb"]
    if settings["mode"] == "disabled":
        return None
    import wandb  # only when asked for: it is slow to import

    # mode offline never talks to the server, so it never asks for a login.
    return wandb.init(
        project=settings["project"], name=settings["name"], mode=settings["mode"], dir=str(out_dir), config=cfg
    )

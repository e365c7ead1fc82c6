"""Checkpoints a killed run resumes from exactly, and never a half-written one.

Layout under ``train.out_dir``:

    checkpoints/step-00000040/           DeepSpeed's save_checkpoint: weights, ZeRO optimizer partitions, lr schedule
    checkpoints/step-00000040/COMPLETE   written last, once every rank's files are on disk
    checkpoints/latest                   DeepSpeed's pointer, kept for its tools (zero_to_fp32.py), never trusted
    head/                                the head alone (``save_pretrained``, atomic), what eval and export read
    config.yaml                          the resolved config

DeepSpeed writes its files in place and rank 0 writes ``latest`` before the other ranks are done
(engine.save_checkpoint, 0.19.8), so a kill during a save can leave a tag directory, and a
``latest`` naming it, that are not usable. Only a tag with ``COMPLETE`` counts: resume loads the
newest one and deletes the others. Pruning removes the marker first, so a kill mid-delete leaves
an incomplete directory, never a "complete" one with files missing.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from core.io import atomic_write_text

MARKER = "COMPLETE"


def checkpoint_dir(out_dir: Path) -> Path:
    return out_dir / "checkpoints"


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def complete_steps(ckpt_dir: Path) -> list[int]:
    """Steps of the finished checkpoints under ``ckpt_dir``, oldest first."""
    return sorted(int(p.name.removeprefix("step-")) for p in ckpt_dir.glob("step-*") if (p / MARKER).is_file())


def has_frozen_parameters(engine: deepspeed.DeepSpeedEngine) -> bool:
    # Medusa-2's module holds the LoRA-wrapped target: its frozen base weights stay out of checkpoints.
    return any(not p.requires_grad for p in engine.module.parameters())


def all_finite(engine: deepspeed.DeepSpeedEngine) -> bool:
    """Every trained weight on every rank is finite (ZeRO-3 ranks check their own partition)."""
    ok = all(bool(torch.isfinite(getattr(p, "ds_tensor", p)).all()) for p in engine.module.parameters())
    flag = torch.tensor([float(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def save_checkpoint(
    engine: deepspeed.DeepSpeedEngine,
    out_dir: Path,
    step: int,
    save_artifacts: Callable[[Path], None],
    keep: int,
) -> Path:
    """DeepSpeed's checkpoint of ``step`` (all ranks), then the head alone, then the completion marker."""
    ckpt_dir, tag = checkpoint_dir(out_dir), tag_for(step)
    frozen = has_frozen_parameters(engine)
    # Returns after DeepSpeed's closing barrier: every rank's files are written.
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": step}, exclude_frozen_parameters=frozen)
    # ZeRO-3 keeps a slice of each weight per rank: gather whole ones for the head's own files.
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        if dist.get_rank() == 0:
            save_artifacts(out_dir)
    if dist.get_rank() == 0:
        atomic_write_text(ckpt_dir / tag / MARKER, json.dumps({"step": step}) + "\n")
        _prune(ckpt_dir, keep)
    dist.barrier()
    return ckpt_dir / tag


def _prune(ckpt_dir: Path, keep: int) -> None:
    for step in complete_steps(ckpt_dir)[:-keep] if keep > 0 else []:
        path = ckpt_dir / tag_for(step)
        (path / MARKER).unlink()
        shutil.rmtree(path)


def resume(engine: deepspeed.DeepSpeedEngine, out_dir: Path, mode: str | bool) -> int:
    """Load the newest complete checkpoint (``mode`` auto/true) and return its step; 0 for a fresh run."""
    ckpt_dir = checkpoint_dir(out_dir)
    steps = complete_steps(ckpt_dir)
    if mode is True and not steps:
        raise FileNotFoundError(f"--resume: no complete checkpoint under {ckpt_dir}")
    if mode is False and steps:
        raise FileExistsError(
            f"{ckpt_dir} holds checkpoints and train.resume is false: resume (train.resume=auto), "
            f"or choose another train.out_dir"
        )
    dist.barrier()  # every rank has listed the checkpoints before rank 0 deletes the unfinished ones
    if dist.get_rank() == 0:
        for path in ckpt_dir.glob("step-*"):
            if path.is_dir() and not (path / MARKER).is_file():
                shutil.rmtree(path)
    if not steps:
        return 0
    strict = not has_frozen_parameters(engine)
    _, client = engine.load_checkpoint(str(ckpt_dir), tag=tag_for(steps[-1]), load_module_strict=strict)
    return int(client["step"])

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

Another process count. ``COMPLETE`` records the world size, ZeRO stage and data-order settings the
checkpoint was written under. ZeRO-0 keeps the whole optimizer state in ``mp_rank_00_model_states.pt``,
so any world size loads it as is. ZeRO-1/2 split the optimizer state into one file per rank (ZeRO-3
the weights too), which DeepSpeed 0.19.8 refuses to load under another data-parallel size ("Automatic
adjustment of ZeRO's optimizer state partitioning ... is not currently supported"); resume then
converts the tag with DeepSpeed's own ``ds_to_universal`` (the per-parameter "universal" layout,
``universal-<tag>``) and the engine is built with ``checkpoint.load_universal`` to read it.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.checkpoint import ds_to_universal

from core.io import atomic_dir, atomic_write_text

MARKER = "COMPLETE"


def checkpoint_dir(out_dir: Path) -> Path:
    return out_dir / "checkpoints"


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def complete_steps(ckpt_dir: Path) -> list[int]:
    """Steps of the finished checkpoints under ``ckpt_dir``, oldest first."""
    return sorted(int(p.name.removeprefix("step-")) for p in ckpt_dir.glob("step-*") if (p / MARKER).is_file())


def read_marker(ckpt_dir: Path, step: int) -> dict[str, Any]:
    return json.loads((ckpt_dir / tag_for(step) / MARKER).read_text())


def newest_marker(out_dir: Path) -> dict[str, Any] | None:
    """The ``COMPLETE`` record of the checkpoint a resume would load, None when there is none."""
    steps = complete_steps(checkpoint_dir(out_dir))
    return read_marker(checkpoint_dir(out_dir), steps[-1]) if steps else None


def loads_universal(marker: dict[str, Any] | None, world: int, zero_stage: int) -> bool:
    """Whether resuming from ``marker`` with ``world`` processes goes through DeepSpeed's universal checkpoint
    (ZeRO-1/2/3 saved under another world size); ValueError where it cannot resume at all."""
    # Checkpoints written before the world size was recorded: DeepSpeed's own check applies.
    if marker is None or marker.get("world", world) == world:
        return False
    if marker["zero_stage"] != zero_stage:
        raise ValueError(
            f"the checkpoint was written under ZeRO stage {marker['zero_stage']} and {marker['world']} processes; "
            f"resuming with another process count ({world}) needs the same stage, not {zero_stage}"
        )
    return zero_stage > 0


def check_data_order(marker: dict[str, Any] | None, order: dict[str, int]) -> None:
    """The samples of step N depend on the seed, the global batch and the training samples, never on the
    process count: a resume that changed one of them would repeat some samples and skip others."""
    if marker is None:
        return
    changed = [f"{k} {marker[k]} -> {v}" for k, v in order.items() if marker.get(k, v) != v]
    if changed:
        raise ValueError(
            f"cannot resume from step {marker['step']}: {', '.join(changed)} (checkpoint -> now) changes which "
            "samples each step sees; keep train.seed, train.batch_size and the data as they were "
            "(micro_batch_size and the process count may change)"
        )


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
    order: dict[str, int],
) -> Path:
    """DeepSpeed's checkpoint of ``step`` (all ranks), then the head alone, then the completion marker
    (which records the world size, ZeRO stage and the data-order settings ``order``)."""
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
        marker = {"step": step, "world": dist.get_world_size(), "zero_stage": engine.zero_optimization_stage(), **order}
        atomic_write_text(ckpt_dir / tag / MARKER, json.dumps(marker) + "\n")
        _prune(ckpt_dir, keep)
    dist.barrier()
    return ckpt_dir / tag


def _prune(ckpt_dir: Path, keep: int) -> None:
    for step in complete_steps(ckpt_dir)[:-keep] if keep > 0 else []:
        path = ckpt_dir / tag_for(step)
        (path / MARKER).unlink()
        shutil.rmtree(path)


def resume(engine: deepspeed.DeepSpeedEngine, out_dir: Path, mode: str | bool, order: dict[str, int]) -> int:
    """Load the newest complete checkpoint (``mode`` auto/true) and return its step; 0 for a fresh run.

    A checkpoint from another process count is loaded through a universal copy (``loads_universal``);
    the engine must then have been built with ``checkpoint.load_universal`` (``build_engine`` does).
    """
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
        for path in ckpt_dir.glob("*universal-step-*"):  # a conversion a kill interrupted
            shutil.rmtree(path)
    if not steps:
        return 0
    marker = read_marker(ckpt_dir, steps[-1])
    check_data_order(marker, order)
    tag = tag_for(steps[-1])
    universal = loads_universal(marker, dist.get_world_size(), engine.zero_optimization_stage())
    if universal:
        if dist.get_rank() == 0:
            to_universal(ckpt_dir / tag, ckpt_dir / f"universal-{tag}")
        dist.barrier()
        tag = f"universal-{tag}"
    strict = not has_frozen_parameters(engine)
    _, client = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_module_strict=strict)
    dist.barrier()  # every rank has read the universal copy: it is not needed again
    if universal and dist.get_rank() == 0:
        shutil.rmtree(ckpt_dir / tag)
        # ds_to_universal's pointer to what it wrote (the temporary name atomic_dir gave it).
        (ckpt_dir / "latest_universal").unlink(missing_ok=True)
    return int(client["step"])


def to_universal(src: Path, dst: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` of one tag: per-parameter fp32 weights and optimizer moments that
    any data-parallel size can re-partition (written atomically; a stale copy is replaced)."""
    with atomic_dir(dst) as tmp:
        args = argparse.Namespace(
            input_folder=str(src),
            output_folder=str(tmp),
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            # Megatron-DeepSpeed writes this (tensor-parallel merge rules); a plain engine has none to give.
            inject_missing_state=True,
        )
        ds_to_universal.main(args)

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

Verified before loaded. DeepSpeed unpickles its files (``torch.load(weights_only=False)``), so a
crafted ``.pt`` file runs code. ``COMPLETE`` records the sha256 of every file of its tag (rank 0
hashes them after DeepSpeed's closing barrier: the checkpoint folder is on storage all ranks share),
and no file of a tag is read before all of them match (``verify_checkpoint``). A tag that does not
verify (truncated, altered, a file missing or added, an unreadable marker) is never loaded: resume
moves it aside to ``corrupt-<tag>`` and falls back to the newest one that verifies. The marker is
the root of trust: whoever can write it can write anything (docs/RELIABILITY.md).

Another process count. ``COMPLETE`` records the world size, ZeRO stage, data-order settings, and the parameters
on Muon and the optimizer's settings (``check_optimizer``) the checkpoint was written under. ZeRO-0 keeps the whole
optimizer state in ``mp_rank_00_model_states.pt``, so any world size loads it as is. ZeRO-1/2 split the optimizer
state into one file per rank (ZeRO-3 the weights too), which DeepSpeed 0.19.8 refuses to load under another
data-parallel size ("Automatic adjustment of ZeRO's optimizer state partitioning ... is not currently supported");
resume then converts the tag with DeepSpeed's own ``ds_to_universal`` (the per-parameter "universal" layout,
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

from headstart.core.io import OutOfSpaceError, atomic_dir, atomic_write_text, free_space_problem, out_of_space_named
from headstart.core.runtime import collective_device
from headstart.data_recipes.shards import file_sha256
from headstart.train.optimizers import muon_parameters

MARKER = "COMPLETE"
MARKER_KEYS = ("step", "world", "zero_stage", "files")


class CorruptCheckpoint(ValueError):
    """A checkpoint whose marker is unreadable or whose files do not match the digests the marker records."""


def checkpoint_dir(out_dir: Path) -> Path:
    return out_dir / "checkpoints"


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def complete_steps(ckpt_dir: Path) -> list[int]:
    """Steps of the finished checkpoints under ``ckpt_dir``, oldest first."""
    return sorted(int(p.name.removeprefix("step-")) for p in ckpt_dir.glob("step-*") if (p / MARKER).is_file())


def file_digests(tag_dir: Path) -> dict[str, str]:
    """The sha256 of every file under ``tag_dir`` but its marker, by path relative to ``tag_dir``."""
    files = (p for p in sorted(tag_dir.rglob("*")) if p.is_file() and p != tag_dir / MARKER)
    return {p.relative_to(tag_dir).as_posix(): file_sha256(p) for p in files}


def read_marker(tag_dir: Path) -> dict[str, Any]:
    """The ``COMPLETE`` record of ``tag_dir``; CorruptCheckpoint when it is not the one save_checkpoint writes."""
    path = tag_dir / MARKER
    try:
        marker = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptCheckpoint(f"{path} is not JSON ({err})") from None
    missing = [key for key in MARKER_KEYS if not isinstance(marker, dict) or key not in marker]
    if missing or not isinstance(marker["files"], dict):
        raise CorruptCheckpoint(
            f"{path} lacks {', '.join(missing) or 'a files table'} (written before file digests were recorded, "
            "or altered): its checkpoint cannot be verified"
        )
    return marker


def verify_checkpoint(tag_dir: Path) -> dict[str, Any]:
    """The marker of ``tag_dir`` once every file matches the sha256 it records, read before any file is
    unpickled; CorruptCheckpoint naming each file that is missing, altered or not recorded at all."""
    marker = read_marker(tag_dir)
    problems = digest_problems(tag_dir, marker["files"], MARKER)
    if problems:
        raise CorruptCheckpoint("; ".join(problems))
    return marker


def digest_problems(folder: Path, recorded: dict[str, str], record: str) -> list[str]:
    """What differs between the files under ``folder`` and the sha256 table ``recorded`` (by relative path) that
    the file ``record`` holds: each file missing, not recorded, or not matching (``[]``: every file verifies).
    Shared by checkpoints and the keep-best record (``train.measured``), so both are bound to their files alike."""
    found = file_digests(folder)
    problems = [f"{folder / name} is missing" for name in recorded if name not in found]
    problems += [f"{folder / name} is not recorded in {record}" for name in found if name not in recorded]
    problems += [
        f"{folder / name} ({(folder / name).stat().st_size} bytes) does not match its sha256 in {record} "
        "(truncated or altered)"
        for name, digest in found.items()
        if name in recorded and recorded[name] != digest
    ]
    return problems


def newest_verified(ckpt_dir: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """The marker of the newest complete checkpoint whose files verify (None when none does), and what is
    wrong with each newer one."""
    problems: list[str] = []
    for step in reversed(complete_steps(ckpt_dir)):
        try:
            return verify_checkpoint(ckpt_dir / tag_for(step)), problems
        except CorruptCheckpoint as err:
            problems.append(str(err))
    return None, problems


def agreed_newest_verified(ckpt_dir: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """``newest_verified`` as rank 0 finds it, handed to every rank so all load (or name) the same step."""
    verdict = [newest_verified(ckpt_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is None:
        raise RuntimeError(f"rank 0's verdict on the checkpoints in {ckpt_dir} did not reach this rank")
    return verdict[0]


def newest_marker(out_dir: Path) -> dict[str, Any] | None:
    """The ``COMPLETE`` record of the newest checkpoint with a readable one, None when there is none.

    Read, not verified: ``build_engine`` needs only the world size it records (``resume`` verifies).
    """
    ckpt_dir = checkpoint_dir(out_dir)
    for step in reversed(complete_steps(ckpt_dir)):
        try:
            return read_marker(ckpt_dir / tag_for(step))
        except CorruptCheckpoint:
            continue
    return None


def loads_universal(marker: dict[str, Any] | None, world: int, zero_stage: int) -> bool:
    """Whether resuming from ``marker`` with ``world`` processes goes through DeepSpeed's universal checkpoint
    (ZeRO-1/2/3 saved under another world size); ValueError where it cannot resume at all."""
    if marker is None or marker["world"] == world:
        return False
    if marker["zero_stage"] != zero_stage:
        raise ValueError(
            f"the checkpoint was written under ZeRO stage {marker['zero_stage']} and {marker['world']} processes; "
            f"resuming with another process count ({world}) needs the same stage, not {zero_stage}"
        )
    return zero_stage > 0


def check_data_order(marker: dict[str, Any] | None, order: dict[str, int | str]) -> None:
    """The samples of step N depend on the seed, the global batch and the training samples (their count
    and the data's fingerprint), never on the process count: a resume that changed one of them would
    train on other samples than the run it continues."""
    if marker is None:
        return
    changed = [f"{k} {marker.get(k, 'unrecorded')} -> {v}" for k, v in order.items() if marker.get(k) != v]
    if changed:
        raise ValueError(
            f"cannot resume from step {marker['step']}: {', '.join(changed)} (checkpoint -> now) changes which "
            "samples each step sees; keep train.seed, train.batch_size and the data as they were "
            "(micro_batch_size and the process count may change)"
        )


def check_optimizer(marker: dict[str, Any], muon_now: list[str], settings: dict[str, Any]) -> None:
    """The optimizer state of a checkpoint holds one set of moments per parameter group: it fits only the grouping
    that wrote it, the same matrices on Muon (``train.optimizer``, ``train.muon_exclude``; DeepSpeed would fail
    mid-load with an unrelated message, "parameter-alignment layout" or an IndexError). Its schedule and parameter
    groups restore the rates, weight decay and betas it was written with (``optimizer_settings``): another value in
    the config would be silently ignored. A marker records what was checked when it was written: the rates alone
    (``learning_rates``) or nothing, and only that is checked."""
    problems = []
    if "muon_parameters" in marker and marker["muon_parameters"] != muon_now:
        before, now = set(marker["muon_parameters"]), set(muon_now)
        changes = ((before - now, "Muon -> AdamW"), (now - before, "AdamW -> Muon"))
        moved = "; ".join(f"{sorted(names)} {way}" for names, way in changes if names)
        problems.append(f"its optimizer state was written with other parameters on Muon ({moved})")
    recorded = marker.get("optimizer_settings", marker.get("learning_rates", {}))
    keys = recorded | settings if "optimizer_settings" in marker else recorded
    problems += [f"train.{k} {recorded.get(k, 'unused')} -> {settings.get(k, 'unused')}" for k in keys
                 if recorded.get(k) != settings.get(k)]  # fmt: skip
    if problems:
        raise ValueError(
            f"cannot resume from step {marker['step']}: {'; '.join(problems)} (checkpoint -> now). A resume continues "
            "the checkpoint's optimizer and schedule: keep train.optimizer, train.muon_exclude, the rates, "
            "weight_decay and betas as they were, or train into another train.out_dir"
        )


def has_frozen_parameters(engine: deepspeed.DeepSpeedEngine) -> bool:
    # Medusa-2's module holds the LoRA-wrapped target: its frozen base weights stay out of checkpoints.
    return any(not p.requires_grad for p in engine.module.parameters())


def all_finite(engine: deepspeed.DeepSpeedEngine) -> bool:
    """Every trained weight on every rank is finite (ZeRO-3 ranks check their own partition)."""
    ok = all(bool(torch.isfinite(getattr(p, "ds_tensor", p)).all()) for p in engine.module.parameters())
    flag = torch.tensor([float(ok)], device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def save_head_files(engine: deepspeed.DeepSpeedEngine, folder: Path, save_artifacts: Callable[[Path], None]) -> None:
    """Rank 0 writes the head's own files under ``folder`` (``save_artifacts``); every rank must call (ZeRO-3 keeps a
    slice of each weight per rank, gathered whole here)."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        if dist.get_rank() == 0:
            save_artifacts(folder)


def checkpoint_bytes(engine: deepspeed.DeepSpeedEngine, ckpt_dir: Path) -> int:
    """What the next checkpoint takes on disk: as much as the newest complete one, or before the first, the trained
    weights plus the optimizer's fp32 copy of them and Adam's two fp32 moments (12 bytes a parameter)."""
    steps = complete_steps(ckpt_dir)
    if steps:
        return sum(p.stat().st_size for p in (ckpt_dir / tag_for(steps[-1])).rglob("*") if p.is_file())
    trained = [p for p in engine.module.parameters() if p.requires_grad]
    # ZeRO-3 leaves each rank a slice of a weight: ds_numel is the whole weight's size.
    return sum(getattr(p, "ds_numel", p.numel()) * (p.element_size() + 12) for p in trained)


def check_room(engine: deepspeed.DeepSpeedEngine, ckpt_dir: Path, step: int) -> None:
    """OutOfSpaceError on every rank when one finds less free space in ``ckpt_dir`` than the checkpoint takes
    (``checkpoint_bytes``): a disk that fills during DeepSpeed's save ends in torch's words ("unexpected pos"),
    naming no file. Every rank stops here together, so none waits in a save the others never began."""
    remedy = "free space there, or keep fewer checkpoints (train.keep_checkpoints)"
    problem = free_space_problem(ckpt_dir, checkpoint_bytes(engine, ckpt_dir), f"the checkpoint of step {step}", remedy)
    short = torch.tensor([float(problem is not None)], device=collective_device())
    dist.all_reduce(short, op=dist.ReduceOp.MAX)
    if short.item():
        raise OutOfSpaceError(problem or f"another rank found too little free space in {ckpt_dir} for step {step}")


def save_checkpoint(
    engine: deepspeed.DeepSpeedEngine,
    out_dir: Path,
    step: int,
    save_artifacts: Callable[[Path], None],
    keep: int,
    order: dict[str, int | str],
    settings: dict[str, Any],
) -> Path:
    """DeepSpeed's checkpoint of ``step`` (all ranks), then the head alone, then the completion marker
    (which records the world size, ZeRO stage, the data-order settings ``order``, the parameters on Muon, the
    optimizer's ``settings`` and every file's sha256).

    Out of room (free space checked first, ``check_room``; a save that still runs out): OutOfSpaceError naming the
    folder, and the last complete checkpoint stays what resume loads."""
    ckpt_dir, tag = checkpoint_dir(out_dir), tag_for(step)
    frozen = has_frozen_parameters(engine)
    check_room(engine, ckpt_dir, step)
    steps = complete_steps(ckpt_dir)
    last = f"{ckpt_dir / tag_for(steps[-1])}, the last complete checkpoint," if steps else "no checkpoint was complete:"
    kept = f"{last} is untouched (resume deletes the unfinished {tag}); free space and resume"
    # Returns after DeepSpeed's closing barrier: every rank's files are written.
    with out_of_space_named(ckpt_dir / tag, kept):
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": step}, exclude_frozen_parameters=frozen)
    save_head_files(engine, out_dir, save_artifacts)
    if dist.get_rank() == 0:
        marker = {"step": step, "world": dist.get_world_size(), "zero_stage": engine.zero_optimization_stage(), **order}
        marker |= {"muon_parameters": muon_parameters(engine.module), "optimizer_settings": settings}
        marker["files"] = file_digests(ckpt_dir / tag)  # every rank's files: on shared storage, all written
        atomic_write_text(ckpt_dir / tag / MARKER, json.dumps(marker) + "\n")
        _prune(ckpt_dir, keep)
    dist.barrier()
    return ckpt_dir / tag


def _prune(ckpt_dir: Path, keep: int) -> None:
    for step in complete_steps(ckpt_dir)[:-keep] if keep > 0 else []:
        path = ckpt_dir / tag_for(step)
        (path / MARKER).unlink()
        shutil.rmtree(path)


def resume(
    engine: deepspeed.DeepSpeedEngine,
    out_dir: Path,
    mode: str | bool,
    order: dict[str, int | str],
    settings: dict[str, Any],
) -> int:
    """Load the newest complete checkpoint whose files verify (``mode`` auto/true) and return its step; 0 for
    a fresh run. Newer ones that do not verify are named, moved aside to ``corrupt-<tag>`` and never read.

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
    marker, problems = agreed_newest_verified(ckpt_dir)
    if marker is None:
        raise CorruptCheckpoint(
            f"no checkpoint under {ckpt_dir} verifies, so none was loaded: {'; '.join(problems)}. "
            f"Restore the files, or move {ckpt_dir} away to start afresh"
        )
    tag = tag_for(marker["step"])
    if problems and dist.get_rank() == 0:
        _set_aside(ckpt_dir, problems, fallback=marker["step"])
    check_data_order(marker, order)
    check_optimizer(marker, muon_parameters(engine.module), settings)
    universal = loads_universal(marker, dist.get_world_size(), engine.zero_optimization_stage())
    if universal != engine.load_universal_checkpoint():
        # build_engine read the newest marker; the fall-back step was written under another process count.
        raise RuntimeError(
            f"{ckpt_dir / tag} was written by {marker['world']} processes and the engine was built for the "
            f"checkpoint after it, which did not verify: start the run again to resume from step {marker['step']}"
        )
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


def last_good(engine: deepspeed.DeepSpeedEngine, out_dir: Path, done: int, save: Callable[..., Path]) -> str:
    """Checkpoint the state after step ``done`` if its weights are finite; name the newest checkpoint whose
    files verify (a state that was finite when saved, and is still what was saved)."""
    ckpt_dir = checkpoint_dir(out_dir)
    if done not in complete_steps(ckpt_dir) and all_finite(engine):
        save(step=done)
    marker, problems = agreed_newest_verified(ckpt_dir)
    passed_over = "".join(f" Not good: {problem}." for problem in problems)
    if marker is None:
        why = "none verifies" if problems else "the weights were non-finite before the first save"
        return f"No checkpoint holds a good state ({why}).{passed_over}"
    step = marker["step"]
    return f"The last good state is {ckpt_dir / tag_for(step)} (step {step}, its files verified).{passed_over}"


def _set_aside(ckpt_dir: Path, problems: list[str], fallback: int) -> None:
    """Move the checkpoints newer than ``fallback`` (each failed verification: ``problems``, newest first) out
    of the way, kept for inspection and never loaded: the resumed run writes its own checkpoints of those steps."""
    newer = [step for step in complete_steps(ckpt_dir) if step > fallback]
    for step, problem in zip(reversed(newer), problems, strict=True):
        path, aside = ckpt_dir / tag_for(step), ckpt_dir / f"corrupt-{tag_for(step)}"
        shutil.rmtree(aside, ignore_errors=True)
        path.rename(aside)
        print(f"{problem}: not loaded, moved to {aside}")
    print(f"{ckpt_dir}: falling back to step {fallback}, the newest checkpoint whose files verify")


def to_universal(src: Path, dst: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` of one tag: per-parameter fp32 weights and optimizer moments that
    any data-parallel size can re-partition (written atomically; a stale copy is replaced).

    ds_to_universal unpickles ``src``'s files: they are verified first (CorruptCheckpoint if they do not).
    """
    verify_checkpoint(src)
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

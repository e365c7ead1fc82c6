"""The DeepSpeed engine a run trains through: its config (the global batch, ZeRO, clipping), the hand-off of the
optimizer and schedule to ``deepspeed.initialize``, and the wait before DeepSpeed first builds its op.

Muon under ZeRO changes two of the config's sections (``zero_config``, ``gradient_clipping``): ZeRO gathers each
Muon matrix's whole gradient and orthogonalises it before the step (``train/optimizers.py``), so what DeepSpeed
then measures and clips as "the gradient" is the orthogonalised update.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from torch import nn
from torch.utils.cpp_extension import _get_build_directory

from headstart.core.runtime import cosine_with_warmup
from headstart.train.checkpoint import loads_universal, newest_marker
from headstart.train.optimizers import build_optimizer
from headstart.train.train_config import Train

if TYPE_CHECKING:  # loop.py imports this module
    from headstart.train.loop import Process


def deepspeed_config(train: Train, world: int, load_universal: bool = False, tp_size: int = 1) -> dict[str, Any]:
    """The engine's config. ``batch_size`` is the global batch, fixed for the run: the process count only
    changes how many micro-batches each rank accumulates (so a run may resume on another count).

    With a split target the ``tp_size`` ranks of a group see the same micro-batches and so compute the same
    gradients: DeepSpeed's mean over all ranks is the mean over the groups, and it counts each sample once per
    rank of its group (``train_batch_size``)."""
    micro, groups = train.micro_batch_size, world // tp_size
    if train.batch_size % (micro * groups):
        raise ValueError(
            f"train.batch_size={train.batch_size} is not a multiple of micro_batch_size x data-parallel "
            f"groups = {micro} x {groups}: pick a process count (or micro_batch_size) that divides it"
        )
    return {
        "train_batch_size": train.batch_size * tp_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": train.batch_size // (micro * groups),
        "gradient_clipping": gradient_clipping(train),
        "zero_optimization": zero_config(train),
        "bf16": {"enabled": train.dtype == "bf16"},
        # The optimizer is torch's AdamW or DeepSpeed's Muon (train/optimizers.py), which ZeRO handles fine but does
        # not list as tested when handed over built.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "checkpoint": {"load_universal": load_universal},
    }


def zero_config(train: Train) -> dict[str, Any]:
    """DeepSpeed's ``zero_optimization`` section: the stage; with Muon at ZeRO-3, no reduce-scatter of gradients
    (that stage gathers each Muon matrix's whole gradient itself, and refuses the two together)."""
    if train.optimizer == "muon" and train.zero_stage == 3:
        return {"stage": 3, "reduce_scatter": False}
    return {"stage": train.zero_stage}


def gradient_clipping(train: Train) -> float:
    """DeepSpeed's ``gradient_clipping``: ``train.max_grad_norm``, but 0 for Muon under ZeRO-1/2/3, which clip the
    orthogonalised update instead of the gradient (DeepSpeed issue #8439): at ``max_grad_norm`` 0.5 that shrank the
    demo DFlash-2's Muon steps up to ~170x (its updates' joint norm is ~84 for full-rank gradients, a size of the
    model rather than of the gradient). Muon needs no clip (Newton-Schulz drops the gradient's scale); its AdamW
    half goes unclipped with it. Without ZeRO, DeepSpeed clips the raw gradients before the optimizer, as plain
    Muon does."""
    if train.optimizer == "muon" and train.zero_stage > 0:
        return 0.0
    return train.max_grad_norm


def build_engine(
    module: nn.Module, train: Train, proc: Process, total: int, vocab_size: int, head_exclude: tuple[str, ...] = ()
) -> deepspeed.DeepSpeedEngine:
    """DeepSpeed over ``module``'s trainable parameters: AdamW or Muon (``train.optimizers``; ``vocab_size`` and
    ``head_exclude`` as ``build_optimizer`` reads them), cosine schedule with warm-up, clipping, ZeRO."""
    optimizer = build_optimizer(module, train, vocab_size, head_exclude)
    multiplier = partial(cosine_with_warmup, warmup=train.warmup_steps, total=total, min_ratio=train.min_lr_ratio)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
    # A checkpoint from another process count is read in DeepSpeed's universal layout (train/checkpoint.py).
    universal = loads_universal(newest_marker(Path(train.out_dir)), proc.world, train.zero_stage)
    config = deepspeed_config(train, proc.world, universal, proc.tp_size)
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=schedule, config=config)
    return engine


# The op DeepSpeed's communication backend compiles on first use where the accelerator has one (the CPU's shared-
# memory all-reduce, ``deepspeed_shm_comm``; none on CUDA), the way ``deepspeed.comm.torch.build_shm_op`` asks.
SHM_COMM_BUILDER = "ShareMemCommBuilder"
# torch's JIT build holds ``<extensions dir>/<op>/lock`` from its start to its end and never touches it, so the
# file's age is the build's. Building deepspeed_shm_comm took 22 s to 356 s (median 122 s) on 2 CPU cores shared
# with other jobs (its .ninja_log, 29 builds, 2026-11-28): a lock older than 10 minutes outlived any live build
# seen, and a start that finds a killed build's lock waits at most that long before it is told.
STALE_LOCK_SECONDS = 600.0


class StaleBuildLock(RuntimeError):
    """A JIT build's lock outlived any build: a killed build left it, and every start would wait on it forever."""


def wait_for_op_build(stale_after: float = STALE_LOCK_SECONDS, poll_seconds: float = 1.0) -> None:
    """Before DeepSpeed builds its op: wait while another process's build holds the op's lock, and fail as soon
    as that lock is older than ``stale_after``. torch's ``FileBaton`` would poll a stale one forever, silently."""
    builder = get_accelerator().get_op_builder(SHM_COMM_BUILDER)
    if builder is None:
        return
    # torch's own rule for the folder: TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/<python>_<device>.
    lock = Path(_get_build_directory(builder.NAME, verbose=False)) / "lock"
    announced = False
    while (age := _age_seconds(lock)) is not None:
        if age > stale_after:
            raise StaleBuildLock(
                f"{lock} has been there for {age / 60:.0f} min, longer than any build of DeepSpeed's "
                f"{builder.NAME} op takes ({stale_after / 60:.0f} min): a killed build left it, and torch would wait "
                f"on it forever. If no build is running (no ninja or c++ process), remove it: rm {lock}"
            )
        if not announced:
            print(
                f"waiting for another process's build of DeepSpeed's {builder.NAME} op to release {lock} "
                f"(taken for a killed build's once {stale_after / 60:.0f} min old)"
            )
            announced = True
        time.sleep(poll_seconds)


def _age_seconds(path: Path) -> float | None:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None

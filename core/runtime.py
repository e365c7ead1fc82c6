"""Device, dtype, seeding and the learning-rate schedule: the CPU is the tested path, CUDA works the same way."""

from __future__ import annotations

import atexit
import math
import os
import random
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from headstart.core.settings import dtype_name

T = TypeVar("T")

_DTYPES = {  # by the settings' names (core.settings.Dtype, StoreDtype)
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,  # capture.store_dtype only: the schema allows it nowhere else
}


def slow_dtype_warning(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why computing in ``dtype`` on ``device`` would be much slower than fp32, or None.

    A CPU without native bf16 (no avx512_bf16 / AMX, e.g. an AVX2-only EPYC) emulates it: EAGLE-3 training on
    SmolLM2 took 128 s per step in bf16 against 10 s in fp32 on such a machine, while a CPU with avx512_bf16
    ran bf16 1.37x faster than fp32 (docs/REAL_TARGETS.md). oneDNN's own check says which kind this is.
    """
    if device.type != "cpu" or dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return (
        f"bf16 on this CPU ({torch.backends.cpu.get_cpu_capability()}, no native bf16) is emulated and about 10x "
        "slower than fp32: set the dtype to fp32 here"
    )


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` picks CUDA when present, else the CPU; anything else is passed to torch."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"config asks for device {name!r} but no CUDA device is available")
    return device


def env_count(name: str, default: int, minimum: int = 1) -> int:
    """The integer environment variable ``name`` (torchrun's WORLD_SIZE, LOCAL_WORLD_SIZE, LOCAL_RANK), at least
    ``minimum``; ValueError naming it and its value otherwise (a 0 would divide by zero further on)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"environment variable {name}={raw!r}: must be an integer >= {minimum} (torchrun sets it)")
    return value


def rank_device(name: str = "auto") -> torch.device:
    """This process's device: ``cuda`` (or ``auto`` on a GPU box) means its own GPU, torchrun's LOCAL_RANK;
    ``cuda`` alone would put every rank on GPU 0."""
    device = resolve_device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", env_count("LOCAL_RANK", 0, minimum=0))
        torch.cuda.set_device(device)
    return device


@dataclass(frozen=True)
class Ranks:
    """This process's place in a torchrun job of ``world`` processes: ``tp_size`` consecutive ranks hold one
    copy of the target split between them (a tensor-parallel group, inside one node where it can be), and the
    ``world // tp_size`` groups split the data. Every rank of a group sees the same batches and computes the same
    results; its first rank writes what the group produces."""

    rank: int = 0
    world: int = 1
    tp_size: int = 1

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def dp_world(self) -> int:
        return self.world // self.tp_size

    @property
    def writes(self) -> bool:
        """Whether this rank writes its group's outputs (shards, reports): the group's first."""
        return self.tp_rank == 0


def join_process_group(device: torch.device, tp_size: int = 1) -> Ranks:
    """This process's ranks in the torchrun job that started it, joining its process group once (gloo on a CPU,
    NCCL on GPUs); a world of one without torchrun. The world must be a whole number of tensor-parallel groups."""
    world = env_count("WORLD_SIZE", 1)
    if world % tp_size:
        raise ValueError(
            f"target.tp_size={tp_size} does not divide the {world} processes torchrun started: the world is "
            f"tp_size x data-parallel groups (torchrun --nproc_per_node {tp_size * max(1, world // tp_size)})"
        )
    if world == 1:
        return Ranks()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        atexit.register(leave_process_group)
    return Ranks(dist.get_rank(), dist.get_world_size(), tp_size)


def leave_process_group() -> None:
    """Destroy this process's group, at exit: a rank that exits with the group alive can abort in its
    communication threads' teardown ("terminate called without an active exception", SIGABRT under torchrun)
    while the other ranks are still finishing."""
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank of the job (nothing to wait for without a process group)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def collective_device() -> torch.device:
    """Where a tensor must live for the process group's collectives: NCCL (the group of CUDA ranks) reduces this
    rank's GPU tensors only, gloo CPU ones."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_over_ranks(value: int) -> int:
    """``value`` summed over the job's ranks (itself without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    total = torch.tensor([value], dtype=torch.long, device=collective_device())
    dist.all_reduce(total)
    return int(total.item())


def rank_zero_value(value: T) -> T:
    """``value`` as the job's rank 0 has it, on every rank (itself where there is no process group).

    For what a rank measures rather than computes, timings above all: the ranks of a split target must take the
    same decisions from them, or their forwards stop matching and the collectives inside hang.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a settings' dtype name, or of another spelling of it (a script's own flag)."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[dtype_name(name)]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}") from None


SEED_BASE = 1_000_003  # a prime above any epoch, step or chunk count a run reaches


def mix_seed(*parts: int) -> int:
    """One seed from a run's seed and the counters that pick a random stream (epoch, step, chunk, ...).

    The parts are folded as digits in base ``SEED_BASE``: ``mix_seed(seed, epoch) == seed * 1_000_003 + epoch``.
    So distinct parts give distinct seeds while every part after the first stays below 1_000_003, the
    same numbers in every process and Python version (no ``hash()``), and with seed 0 the counters are
    their own seeds. Taken modulo 2**64, the range ``torch.manual_seed`` accepts.
    """
    seed = 0
    for part in parts:
        seed = seed * SEED_BASE + part
    return seed % 2**64


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def cosine_with_warmup(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """lr multiplier for optimizer step ``step`` (0-based): linear warm-up ``(step + 1) / warmup`` up to 1 at
    step ``warmup - 1``, then a half cosine from 1 at step ``warmup`` down to ``min_ratio`` at step ``total``
    (and after).

    The decay is transformers' ``get_cosine_with_min_lr_schedule_with_warmup`` (``min_lr_rate=min_ratio``),
    to the bit; its warm-up is ``step / warmup`` instead, which trains the first step at lr 0 and reaches
    the peak one step later. No shift of ``step`` makes the two equal (this warm-up ends on the step before
    the decay starts at 1, so the peak lasts two steps), and the trained heads, the bundled models and the
    figures in docs/BENCHMARKS.md come from this one.
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = min((step - warmup) / max(1, total - warmup), 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def prepare_decoding(device: torch.device) -> None:
    """Backend settings for token-by-token decoding on ``device``.

    cuDNN's attention (torch's first SDPA choice for bf16/fp16 on recent GPUs) builds an execution plan
    for every new (query, key) length, and decoding grows the key length every step: on an H100 the
    bf16 demo target decoded at 37 tokens/s while plans were built and 110 once they were cached. The
    flash and memory-efficient kernels need no plan, so decoding leaves cuDNN's out.
    """
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)

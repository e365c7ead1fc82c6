"""The one device-synchronised timer: CUDA runs kernels asynchronously, so a clock read must wait for them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` once the work queued on ``device`` has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def timed(device: torch.device, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """(``fn(*args)``, the seconds it took on ``device``, its queued kernels included)."""
    start = clock(device)
    result = fn(*args)
    return result, clock(device) - start

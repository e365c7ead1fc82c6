"""What a GPU can do at best, from its datasheet: the dense bf16 tensor-core rate (FLOP/s, no sparsity) and the
memory bandwidth (bytes/s). ``scripts.bench.gpu`` divides by them: MFU is the model's FLOPs over step time over the
peak rate, the weight-read floor is the bandwidth over the bytes a decoding step must read.
"""

from __future__ import annotations

from typing import NamedTuple


class DevicePeak(NamedTuple):
    bf16_flops: float  # dense bf16 tensor-core FLOP/s
    memory_bytes_per_s: float


# Matched against torch.cuda.get_device_name (e.g. "NVIDIA H100 80GB HBM3"), most specific first: "H100 PCIe"
# before "H100". SXM parts where the name does not say.
KNOWN_DEVICES: tuple[tuple[str, DevicePeak], ...] = (
    ("GH200", DevicePeak(989.4e12, 4.0e12)),
    ("H200", DevicePeak(989.4e12, 4.8e12)),
    ("H100 PCIe", DevicePeak(756.0e12, 2.0e12)),
    ("H100 NVL", DevicePeak(835.0e12, 3.9e12)),
    ("H100", DevicePeak(989.4e12, 3.35e12)),
    ("B200", DevicePeak(2250.0e12, 8.0e12)),
    ("A100-SXM4-80GB", DevicePeak(312.0e12, 2.039e12)),
    ("A100 80GB PCIe", DevicePeak(312.0e12, 1.935e12)),
    ("A100", DevicePeak(312.0e12, 1.555e12)),
    ("L40S", DevicePeak(362.1e12, 0.864e12)),
    ("A10G", DevicePeak(125.0e12, 0.6e12)),
)


def device_peak(name: str) -> DevicePeak | None:
    """The datasheet peaks of the GPU called ``name``; None for a CPU or a GPU not in the table."""
    for key, peak in KNOWN_DEVICES:
        if key in name:
            return peak
    return None

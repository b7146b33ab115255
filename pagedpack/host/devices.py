"""Which kind of device a tensor, a ``torch.device`` or a device string names: the one place that
compares device types (a test holds the rest of the code to it).

A string is read as written ("npu:0" -> "npu"): ``torch.device("npu:0")`` needs torch_npu imported."""
from __future__ import annotations

import torch


def device_type(device: torch.Tensor | torch.device | str) -> str:
    """``"cpu"`` for ``"cpu:0"``, a CPU tensor or ``torch.device("cpu")``; likewise for other types."""
    if isinstance(device, torch.Tensor):
        return device.device.type
    if isinstance(device, torch.device):
        return device.type
    return str(device).split(":")[0]


def is_cpu(device: torch.Tensor | torch.device | str) -> bool:
    return device_type(device) == "cpu"


def is_npu(device: torch.Tensor | torch.device | str) -> bool:
    return device_type(device) == "npu"

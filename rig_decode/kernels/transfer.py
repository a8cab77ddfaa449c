"""Host-to-device copies that do not wait for the device's queued work."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``. From the host to CUDA the copy goes through pinned memory and is queued
    on the stream: it does not wait for the GPU's work (a copy from pageable memory would)."""
    device = torch.device(device)
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)  # towards the host a non-blocking copy could be read before it lands

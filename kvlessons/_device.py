"""Which device the lessons run on (every lesson's setup cell: ``kvlessons.device()``)."""

from __future__ import annotations

import os

import torch

ENV_VAR = "KVLESSONS_DEVICE"


def device() -> torch.device:
    """Return the device lessons use: $KVLESSONS_DEVICE if set, else CUDA when present, else CPU."""
    wanted = os.environ.get(ENV_VAR, "").strip()
    if wanted:
        try:
            dev = torch.device(wanted)
        except (RuntimeError, ValueError) as err:
            raise ValueError(f"{ENV_VAR}={wanted!r} is not a torch device name ({err})") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"{ENV_VAR}={wanted!r} but this PyTorch sees no CUDA device")
        return dev
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(dev: torch.device | str | None = None) -> None:
    """Wait for queued GPU work so a timer measures it; a no-op on CPU."""
    dev = torch.device(dev) if dev is not None else device()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)

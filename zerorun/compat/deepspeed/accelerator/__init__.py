"""``deepspeed.accelerator.get_accelerator()``: the device this rank trains on, as zerorun chose
it (``ZERORUN_DEVICE``; CUDA when available otherwise). CUDA and CPU only."""

from __future__ import annotations

import os
from typing import Any

import torch

from zerorun.compat.deepspeed._surface import missing, module_getattr

__all__ = ["get_accelerator", "Accelerator"]

__getattr__ = module_getattr(__name__)


class Accelerator:
    """The subset of DeepSpeed's accelerator interface that training code uses."""

    def __init__(self) -> None:
        wanted = os.environ.get("ZERORUN_DEVICE")
        self._cuda = wanted != "cpu" and torch.cuda.is_available()
        self._name = "cuda" if self._cuda else "cpu"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise missing(f"deepspeed.accelerator.get_accelerator().{name}")

    def device_name(self, device_index: int | str | None = None) -> str:
        if device_index is None or not self._cuda:
            return self._name
        return f"cuda:{device_index}"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return os.environ.get("ZERORUN_BACKEND") or ("nccl" if self._cuda else "gloo")

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    # As DeepSpeed's CUDA accelerator: only the GPU generators (the CPU's is left as it was; the
    # CPU accelerator seeds the CPU's).
    def manual_seed(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name


_accelerator: Accelerator | None = None


def get_accelerator() -> Accelerator:
    global _accelerator
    if _accelerator is None:
        _accelerator = Accelerator()
    return _accelerator

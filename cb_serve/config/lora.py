"""``LoRAConfig``: how many adapters an engine holds, and how large."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # default: max_loras

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.max_cpu_loras is not None and (
            not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras
        ):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras, got {self.max_cpu_loras!r}.")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras

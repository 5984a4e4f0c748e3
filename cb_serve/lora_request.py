"""``LoRARequest``: which adapter a request runs with (vLLM's interface)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory under a name. ``lora_int_id`` is a positive id, as in vLLM; an
    adapter is identified by all three fields, so one name reloaded from another path is another
    adapter (it never shares cached KV with the old one)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}.")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}.")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}.")

    @property
    def key(self) -> tuple[str, int, str]:
        return (self.lora_name, self.lora_int_id, self.lora_path)

    @property
    def cache_salt(self) -> bytes:
        """The parent hash of a sequence's first KV block: prefix-cache entries of two adapters
        (or of an adapter and the base model) never match."""
        return hashlib.sha256("\0".join(("lora", *map(str, self.key))).encode()).digest()

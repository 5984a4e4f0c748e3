"""The adapters a router serves under the OpenAI ``model`` field: those of the config
(``lora_modules``, vLLM's ``--lora-modules``) and those loaded at run time
(``POST /v1/load_lora_adapter``)."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from cb_serve import LoRARequest

MAX_LORA_NAME = 128


def lora_int_id(name: str, path: str, nonce: str = "") -> int:
    """A positive id fixed by the adapter's name and path (and ``nonce``), so every router process
    names a config adapter alike (the engines key cached KV by it)."""
    digest = hashlib.sha256(f"{name}\0{path}\0{nonce}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % (2**31 - 1) + 1


def check_lora_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_LORA_NAME:
        raise ValueError(f"lora_name must be a non-empty string of at most {MAX_LORA_NAME} characters.")
    return name


class LoRARegistry:
    def __init__(self, modules: dict[str, str] | None = None) -> None:
        self.adapters: dict[str, LoRARequest] = {}
        for name, path in (modules or {}).items():
            self.add(name, path)

    def add(self, name: str, path: str, fresh: bool = False) -> LoRARequest:
        """``fresh``: a new id even for a name and path seen before (a run-time load: the files may
        have changed, so nothing an engine held or cached under the old id is reused)."""
        nonce = secrets.token_hex(8) if fresh else ""
        request = LoRARequest(check_lora_name(name), lora_int_id(name, path, nonce), path)
        self.adapters[name] = request
        return request

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def remove(self, name: str) -> LoRARequest | None:
        return self.adapters.pop(name, None)

    def model_cards(self, base: str, max_model_len: int | None = None) -> list[dict[str, Any]]:
        """``/v1/models`` entries: the base model, then each adapter with its ``parent`` (as vLLM lists
        them), each with the context length (vLLM's ``max_model_len``)."""
        card = {"object": "model", "created": 0, "owned_by": "cb-serve", "max_model_len": max_model_len}
        adapters = [
            {**card, "id": name, "root": r.lora_path, "parent": base} for name, r in sorted(self.adapters.items())
        ]
        return [{**card, "id": base, "root": base, "parent": None}, *adapters]

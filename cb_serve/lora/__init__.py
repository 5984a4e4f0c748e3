"""Many LoRA adapters on one base model, batched in the ragged step (``LoRARequest``,
``peft_adapter`` loading, ``LoRAManager``'s slots, ``LoRALinear``'s grouped apply)."""

from cb_serve.lora_request import LoRARequest

__all__ = ["LoRARequest"]

"""The batch inspector's layer x expert heat map of a mixture-of-experts model: each recent step's
expert load (``ExpertLoad``, from the driver's model), summed over the last steps when the page asks.
A dense model records nothing here."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from cb_serve.stats import ExpertLoad

HEATMAP_STEPS = 60  # the steps summed: the inspector page's step columns


class ExpertHeatmap:
    """The last ``max_steps`` steps' tokens per expert of every MoE layer (engine thread only)."""

    def __init__(self, max_steps: int = HEATMAP_STEPS) -> None:
        self.steps: deque[tuple[int, np.ndarray]] = deque(maxlen=max_steps)
        self.layers: tuple[int, ...] = ()

    def add(self, step_id: int, load: ExpertLoad | None) -> None:
        if load is not None:
            self.layers = load.layers
            self.steps.append((step_id, load.counts))

    def view(self) -> dict[str, Any] | None:
        """The heat map (None before a step of a mixture-of-experts model): ``tokens[i][e]``, the
        tokens the router of decoder layer ``layers[i]`` sent to expert ``e`` over steps
        ``first_step``..``last_step`` (each token counted once per expert it went to)."""
        if not self.steps:
            return None
        tokens = np.sum([counts for _, counts in self.steps], axis=0)
        return {
            "layers": list(self.layers),
            "num_experts": int(tokens.shape[1]),
            "steps": len(self.steps),
            "first_step": self.steps[0][0],
            "last_step": self.steps[-1][0],
            "tokens": tokens.tolist(),
        }

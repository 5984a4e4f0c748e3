"""``CoreRequest``: what the engine thread holds of a request (vLLM v1's ``Request``): its ``n``
sequences and the stop conditions that need no text. Its text, stop strings and outputs are the
front end's (``request_state.RequestState``)."""

from __future__ import annotations

import itertools

from cb_serve.engine.processor import ProcessedRequest
from cb_serve.engine.stop_checker import StopChecker
from cb_serve.sequence import Sequence

_SEQ_IDS = itertools.count()  # unique in the process: request ids are the clients' and may look like anything


class CoreRequest:
    __slots__ = ("request_id", "params", "faults", "stop_checker", "seqs", "prompt_tokens_counted", "wants_logprobs")

    def __init__(
        self, request_id: str, req: ProcessedRequest, arrival_time: float, faults: frozenset[str] = frozenset()
    ) -> None:
        self.request_id = request_id
        self.params = req.params
        self.faults = faults  # fault-injection kinds this request carries (tests)
        self.stop_checker = StopChecker(req.params)  # its token stops here; its stop strings in the front end
        self.wants_logprobs = req.params.logprobs is not None
        n = req.params.n
        self.seqs = [
            Sequence(
                next(_SEQ_IDS),
                request_id,
                i,
                req.prompt_token_ids,
                req.params.for_child(i) if n > 1 else req.params,
                req.max_tokens,
                arrival_time,
                self.stop_checker.stop_ids,
                req.lora_request,
                req.priority,
                req.mm_features,
            )
            for i in range(n)
        ]
        self.prompt_tokens_counted = False  # counted once per request (vLLM), whatever n

    @property
    def finished(self) -> bool:
        return all(s.status.is_finished for s in self.seqs)

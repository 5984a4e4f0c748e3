"""The batch inspector's side of a Router replica: which engine replicas are live, one replica's views
(``EngineReplica.inspect``, reached by replica id through the request router: ``InspectRequest``), which
replica served each recent request, and who may look (``router.inspector``; the API key, as a bearer token
or as the password of HTTP Basic auth, what a browser can send to a page and its EventSource)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import secrets
import time
from collections import OrderedDict
from typing import Any

import ray
from fastapi import Request
from ray.serve.handle import DeploymentHandle

from cb_serve.serve.api_error import APIError
from cb_serve.serve.engine_request import InspectRequest

INSPECT_TIMEOUT_S = 10.0
INSPECT_ATTEMPTS = 5
REPLICA_LIST_TTL_S = 2.0
MAX_REMEMBERED_REQUESTS = 10_000  # request id -> replica, for timeline lookups
STEPS_PER_VIEW = 60


async def _await(response: Any) -> Any:
    return await response


class Inspector:
    """One Router replica's inspector state: the live replicas (cached briefly), the replica each recent
    request ran on, and one targeted call at a time."""

    def __init__(self, engine: DeploymentHandle, enabled: bool, api_key: str | None) -> None:
        self.engine, self.enabled, self.api_key = engine, enabled, api_key
        self.served_by: OrderedDict[str, str] = OrderedDict()  # request id -> replica
        self._replica_list: tuple[float, list[str]] = (-REPLICA_LIST_TTL_S, [])
        self._lock = asyncio.Lock()

    def remember(self, request_id: str, replica: str) -> None:
        self.served_by[request_id] = replica
        while len(self.served_by) > MAX_REMEMBERED_REQUESTS:
            self.served_by.popitem(last=False)

    def authorize(self, request: Request) -> None:
        if not self.enabled:
            raise APIError(404, "The batch inspector is turned off (router: inspector: false).", "not_found_error")
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        key = value
        if scheme.lower() == "basic":
            try:
                key = base64.b64decode(value, validate=True).decode().partition(":")[2]
            except (binascii.Error, UnicodeDecodeError):
                key = ""
        elif scheme.lower() != "bearer":
            key = ""
        if not secrets.compare_digest(key.encode(), self.api_key.encode()):
            raise APIError(
                401,
                "Invalid or missing API key (Authorization: Bearer <key>, or Basic with the key as password).",
                "authentication_error",
                headers={"WWW-Authenticate": 'Basic realm="cb-serve inspector"'},
            )

    async def replicas(self) -> list[str]:
        """Ids of the live engine replicas (Serve's named replica actors), cached briefly."""
        fetched, ids = self._replica_list
        if time.monotonic() - fetched < REPLICA_LIST_TTL_S:
            return ids
        prefix = f"SERVE_REPLICA::{self.engine.app_name}#{self.engine.deployment_name}#"
        actors = await asyncio.to_thread(ray.util.list_named_actors, True)
        ids = sorted(a["name"][len(prefix) :] for a in actors if a["name"].startswith(prefix))
        self._replica_list = (time.monotonic(), ids)
        return ids

    async def view(self, replica: str, view: str, **kwargs: Any) -> Any:
        """``view`` of ``replica``. One at a time per Router: Ray hands a replica its request
        router picked to the oldest pending request, so concurrent targeted calls could swap
        replicas; an answer from another replica (a swap with an engine request) is retried."""
        async with self._lock:
            for _ in range(INSPECT_ATTEMPTS):
                response = self.engine.inspect.remote(InspectRequest(view, kwargs, target_replica=replica))
                try:
                    result = await asyncio.wait_for(_await(response), INSPECT_TIMEOUT_S)
                except asyncio.TimeoutError:
                    response.cancel()
                    raise APIError(503, f"Engine replica {replica!r} did not answer.", "service_unavailable") from None
                if result["replica"] == replica:
                    return result["data"]
        message = "The request router did not reach that replica (the inspector needs KVCacheAwareRouter)."
        raise APIError(503, message, "service_unavailable")

    async def replica_or_first(self, replica: str | None) -> str:
        replicas = await self.replicas()
        if replica is None and replicas:
            return replicas[0]
        if replica not in replicas:
            raise APIError(404, f"No engine replica {replica!r} (live: {replicas}).", "not_found_error", "replica")
        return replica

    async def state(self, replica: str, after_step: int, limit: int = STEPS_PER_VIEW) -> dict[str, Any]:
        state = await self.view(replica, "state", after_step=after_step, limit=limit)
        if state is None:
            raise APIError(404, "This replica records no steps (engine: inspector_steps: 0).", "not_found_error")
        return {"replica": replica, "time": time.time(), **state}

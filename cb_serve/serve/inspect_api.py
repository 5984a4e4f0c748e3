"""HTTP side of the batch inspector, mixed into the ``Router``: the live page (``/inspect``),
its event stream, per-request timelines and Chrome trace export.

Every view comes from one engine replica (``EngineReplica.inspect``), which the request router
targets by replica id (``InspectRequest``). Debug routes answer 404 when ``router.inspector``
is false and need the API key when one is set, as a bearer token or as the password of HTTP
Basic auth (what a browser can send to a page and its EventSource).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import ray
from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from ray.serve.handle import DeploymentHandle

from cb_serve.serve.api_error import APIError
from cb_serve.serve.engine_request import InspectRequest

debug_routes = APIRouter()

INSPECT_TIMEOUT_S = 10.0
INSPECT_ATTEMPTS = 5
REPLICA_LIST_TTL_S = 2.0
MAX_STREAM_S = 600.0  # an event stream ends after this (EventSource reconnects by itself)
MAX_TRACE_S = 600.0
MAX_REMEMBERED_REQUESTS = 10_000  # request id -> replica, for timeline lookups
STEPS_PER_VIEW = 60
MAX_STEPS_PER_VIEW = 2000


async def _await(response: Any) -> Any:
    return await response


def _page() -> str:
    return resources.files("cb_serve.serve").joinpath("static/inspect.html").read_text(encoding="utf-8")


class InspectorRoutes:
    """The Router's debug routes; the Router sets ``engine``, ``api_key`` and ``settings``."""

    engine: DeploymentHandle
    api_key: str | None
    settings: Any

    def _init_inspector(self) -> None:
        self._served_by: OrderedDict[str, str] = OrderedDict()  # request id -> replica
        self._replica_list: tuple[float, list[str]] = (-REPLICA_LIST_TTL_S, [])
        self._inspect_lock = asyncio.Lock()

    def _remember_replica(self, request_id: str, replica: str) -> None:
        self._served_by[request_id] = replica
        while len(self._served_by) > MAX_REMEMBERED_REQUESTS:
            self._served_by.popitem(last=False)

    def _authorize_debug(self, request: Request) -> None:
        if not self.settings.inspector:
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

    async def _replicas(self) -> list[str]:
        """Ids of the live engine replicas (Serve's named replica actors), cached briefly."""
        fetched, ids = self._replica_list
        if time.monotonic() - fetched < REPLICA_LIST_TTL_S:
            return ids
        prefix = f"SERVE_REPLICA::{self.engine.app_name}#{self.engine.deployment_name}#"
        actors = await asyncio.to_thread(ray.util.list_named_actors, True)
        ids = sorted(a["name"][len(prefix) :] for a in actors if a["name"].startswith(prefix))
        self._replica_list = (time.monotonic(), ids)
        return ids

    async def _inspect(self, replica: str, view: str, **kwargs: Any) -> Any:
        """``view`` of ``replica``. One at a time per Router: Ray hands a replica its request
        router picked to the oldest pending request, so concurrent targeted calls could swap
        replicas; an answer from another replica (a swap with an engine request) is retried."""
        async with self._inspect_lock:
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

    async def _replica_or_first(self, replica: str | None) -> str:
        replicas = await self._replicas()
        if replica is None and replicas:
            return replicas[0]
        if replica not in replicas:
            raise APIError(404, f"No engine replica {replica!r} (live: {replicas}).", "not_found_error", "replica")
        return replica

    @debug_routes.get("/inspect")
    async def inspect_page(self, request: Request) -> HTMLResponse:
        """The live batch inspector (self-contained HTML, CSS and JS)."""
        self._authorize_debug(request)
        return HTMLResponse(_page(), headers={"Cache-Control": "no-store"})

    @debug_routes.get("/debug/replicas")
    async def debug_replicas(self, request: Request) -> dict[str, Any]:
        self._authorize_debug(request)
        return {"replicas": await self._replicas()}

    @debug_routes.get("/debug/state")
    async def debug_state(
        self,
        request: Request,
        replica: str | None = None,
        after_step: int = Query(-1, ge=-1),
        limit: int = Query(STEPS_PER_VIEW, ge=1, le=MAX_STEPS_PER_VIEW),
    ) -> dict[str, Any]:
        """One replica's recent steps (the last ``limit`` after ``after_step``), KV block map and queues."""
        self._authorize_debug(request)
        replica = await self._replica_or_first(replica)
        return await self._state(replica, after_step, limit)

    async def _state(self, replica: str, after_step: int, limit: int = STEPS_PER_VIEW) -> dict[str, Any]:
        state = await self._inspect(replica, "state", after_step=after_step, limit=limit)
        if state is None:
            raise APIError(404, "This replica records no steps (engine: inspector_steps: 0).", "not_found_error")
        return {"replica": replica, "time": time.time(), **state}

    @debug_routes.get("/debug/events")
    async def debug_events(
        self, request: Request, replica: str | None = None, interval: float = Query(0.5, ge=0.1, le=10)
    ) -> StreamingResponse:
        """Server-sent events: one ``state`` snapshot per ``interval`` (new steps only)."""
        self._authorize_debug(request)
        replica = await self._replica_or_first(replica)
        first = await self._state(replica, -1)

        async def events() -> AsyncIterator[str]:
            state, deadline = first, time.monotonic() + MAX_STREAM_S
            while True:
                yield f"data: {json.dumps(state)}\n\n"
                if time.monotonic() > deadline:
                    return
                await asyncio.sleep(interval)
                last = state["steps"][-1]["step"] if state["steps"] else -1
                try:
                    state = await self._state(replica, last)
                except APIError as e:  # the replica went away: say so, and end (the page reconnects)
                    yield f"event: error\ndata: {json.dumps({'message': e.message})}\n\n"
                    return

        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    @debug_routes.get("/debug/trace")
    async def debug_trace(
        self, request: Request, seconds: float = Query(10.0, gt=0, le=MAX_TRACE_S), replica: str | None = None
    ) -> JSONResponse:
        """Chrome trace-event JSON of the last ``seconds``: one process per replica (all replicas
        merged unless ``replica`` is given). Opens in Perfetto UI and chrome://tracing."""
        self._authorize_debug(request)
        replicas = [await self._replica_or_first(replica)] if replica else await self._replicas()
        since = time.time() - seconds
        parts: list[Any] = []
        for i, r in enumerate(replicas):
            try:
                parts.append(await self._inspect(r, "trace", since=since, pid=i + 1))
            except APIError as e:
                parts.append(e)
        events = [e for part in parts if isinstance(part, list) for e in part]
        missing = {r: repr(part) for r, part in zip(replicas, parts) if not isinstance(part, list)}
        meta = {"replicas": replicas, "missing": missing, "seconds": seconds}
        return JSONResponse({"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta})

    @debug_routes.get("/v1/requests/{request_id}/timeline")
    async def request_timeline(self, request: Request, request_id: str) -> dict[str, Any]:
        """A recent request's timeline, from the replica that served it."""
        self._authorize_debug(request)
        replicas = await self._replicas()
        known = self._served_by.get(request_id)
        order = [known] if known in replicas else replicas  # another Router replica served it: ask all
        for replica in order:
            timeline = await self._inspect(replica, "timeline", request_id=request_id)
            if timeline is not None:
                return {**timeline, "replica": replica}
        message = f"No timeline of request {request_id!r} (only recent requests are kept)."
        raise APIError(404, message, "not_found_error")

"""radixserve on Ray Serve: engine replicas behind an OpenAI-compatible ingress, each request
sent to a replica by a `radixserve.sched.routing` policy inside Serve's own request path.

The application (`build_app`) has two deployments:

- `EngineReplica` (N replicas): one `Engine` on an `EngineWorker`. It publishes its tree's KV
  events on a ZMQ port of its node and names the address in its replica metadata, reports its
  queue in its routing stats, and fails its health check when the engine thread has died or
  stalled, so that Serve restarts it.
- `Ingress` (one replica): `/v1/completions`, `/v1/chat/completions`, `/v1/models` and
  `/generate`, streaming included, with the validation and errors of `radixserve serve`. It
  tokenizes and validates before routing, so a bad request never reaches a replica and the
  router sees token ids.

`RadixRequestRouter`, a Serve `RequestRouter` chosen through `RequestRouterConfig`, picks the
replica. It reads the prompt's token ids from the call's first argument (a `RouteKey`), and
ranks replicas with the policy over its own in-flight accounting (`router.state.Router`, as
the HTTP router does), the running counts the replicas report in their routing stats, and
the replicas' KV events, which threads of its own follow over ZMQ.
It never blocks: no `ray.get`, no remote call. A replica that dies has its pages forgotten at
once, and the replica Serve starts in its place takes its slot with nothing carried over. A
request whose replica dies before it starts is sent to another; one whose replica dies while
it runs ends with a 503 that says so.

This is the only module that imports `ray`; import it only when Ray is wanted.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from radixserve.errors import InvalidArgumentError
from radixserve.router.state import Router, follow_events
from radixserve.sched.request import prepare_request
from radixserve.server.dispatch import Dispatcher, Group, Part
from radixserve.server.errors import APIError
from radixserve.server.worker import EngineDeadError

log = logging.getLogger(__name__)

APP_NAME = "radixserve"
_REPLICA_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


@dataclass(frozen=True)
class RouteKey:
    """What the router reads of a request: its prompt's token ids, its session, and its
    prompt text (for routers that match text, such as Ray's PrefixCacheAffinityRouter)."""

    input_ids: list[int]
    session: str | None = None
    prompt: str = ""


# -- the replicas -----------------------------------------------------------------------------


class EngineReplica:
    """One engine serving the parts of requests the ingress sends it."""

    def __init__(
        self,
        engine_options: dict,
        max_queued_requests: int = 1024,
        request_timeout: float | None = None,
        watchdog: float | None = 60.0,
        kv_events: bool = True,
    ) -> None:
        from radixserve.engine import Engine
        from radixserve.server.worker import EngineWorker

        self.engine = engine = Engine(**{**engine_options, "enable_kv_events": kv_events})
        self.publisher = None
        if kv_events:
            from radixserve.server.kv_events import KVEventPublisher

            host = ray.util.get_node_ip_address()
            medium = "GPU" if engine.device.type == "cuda" else "CPU"
            self.publisher = KVEventPublisher(f"tcp://{host}:*", medium=medium)
        self.worker = EngineWorker(
            engine,
            max_queued_requests,
            request_timeout=request_timeout,
            watchdog=watchdog,
            kv_events=self.publisher,
        )
        self.worker.start()
        self.dispatcher = Dispatcher(engine, self.worker)

    def describe(self, key: RouteKey | None = None) -> dict:
        """What the ingress needs to validate requests as this engine would. (`key` is
        ignored: it gives routers that read every call's first argument one to read.)"""
        engine = self.engine
        return {
            "model_name": engine.model_name,
            "vocab_size": engine.model.config.vocab_size,
            "max_context": engine.max_context,
            "page_size": engine.config.page_size,
        }

    def record_replica_metadata(self) -> dict:
        return {"kv_events_endpoint": self.publisher.endpoint if self.publisher else None}

    def record_routing_stats(self) -> dict:
        snap = self.worker.snapshot
        return {"waiting": snap.waiting, "running": snap.running}

    def check_health(self) -> None:
        healthy, details = self.worker.health()
        if not healthy:
            raise RuntimeError(f"the engine is {details['status']}")

    async def generate(
        self, key: RouteKey, parts: list[Part], grammar_param: str | None = None
    ) -> AsyncIterator:
        """`("ok",)` once the parts are queued, then lists of (part index, chunk or error)
        until every part has ended; or one `("error", status, message, param, code)`.
        Cancelling the call aborts the parts still running."""
        try:
            group = await self.dispatcher.submit(parts, grammar_param)
        except APIError as exc:
            yield ("error", exc.status, exc.message, exc.param, exc.code)
            return
        yield ("ok",)
        async for batch in group.batches():
            yield batch

    def __del__(self) -> None:
        for part in ("worker", "dispatcher", "publisher"):
            closer = getattr(
                getattr(self, part, None), "stop" if part == "worker" else "close", None
            )
            if closer is not None:
                closer()


# -- the router -------------------------------------------------------------------------------


class RadixRequestRouter(RequestRouter):
    """Serve's request router running a radixserve routing policy (see the module doc).

    `request_router_kwargs`: `policy` (a `sched.routing` name), `replicas` (the slots the
    policy has; replicas past that many are tried last), `page_size` (the engines'),
    `events_timeout` (seconds without a KV event batch before a replica's pages are
    forgotten) and `retry_after` (seconds a dead replica's slot is tried last).
    """

    def initialize_state(
        self,
        policy: str = "precise",
        replicas: int = 1,
        page_size: int = 1,
        events_timeout: float = 10.0,
        retry_after: float = 5.0,
    ) -> None:
        self.state = Router(
            [f"slot-{k}" for k in range(replicas)],
            policy,
            page_size,
            retry_after=retry_after,
            events_timeout=events_timeout,
        )
        self._slots: dict[ReplicaID, int] = {}
        self._followers: dict[int, threading.Event] = {}
        self._requests: dict[str, tuple[int, int]] = {}  # internal id -> (slot, router id)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        self._sync_slots()
        key = route_key(pending_request)
        ids, session = (key.input_ids, key.session) if key is not None else ([], None)
        by_slot = {
            self._slots[r.replica_id]: r for r in candidate_replicas if r.replica_id in self._slots
        }
        order = [k for k in self.state.order(ids, session) if k in by_slot]
        if order and pending_request is not None:
            self._account(pending_request, order[0], len(ids))
        extra = [r for r in candidate_replicas if r.replica_id not in self._slots]
        ranked = [[by_slot[k]] for k in order]
        return [*ranked, extra] if extra else ranked

    def _account(self, pending_request: PendingRequest, slot: int, tokens: int) -> None:
        """Count the request as in flight on its first choice until Serve says it completed,
        from the moment of choosing, so that choices made while it is being sent see it.
        Replicas accept up to `max_queued_requests`, so the first choice is where it goes;
        a request chosen again (a retry) moves."""
        internal_id = pending_request.metadata.internal_request_id
        earlier = self._requests.pop(internal_id, None)
        if earlier is not None:  # chosen again (a retry): it is no longer there
            self.state.end(*earlier)
        self._requests[internal_id] = (slot, self.state.start(slot, tokens))

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        routed = self._requests.pop(internal_request_id, None)
        if routed is not None:
            self.state.end(*routed)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._release(replica_id)

    def _sync_slots(self) -> None:
        """Give each new replica a free slot; free the slots of replicas that are gone; take
        each replica's reported running count; follow the KV events of each slotted replica
        once it has named its endpoint."""
        live = self.curr_replicas
        for replica_id in [r for r in self._slots if r not in live]:
            self._release(replica_id)
        taken = set(self._slots.values())
        free = [k for k in range(len(self.state.backends)) if k not in taken]
        for replica_id, replica in live.items():
            slot = self._slots.get(replica_id)
            if slot is None and free:
                slot = self._slots[replica_id] = free.pop(0)
                self.state.replace(slot, replica_id.unique_id)
                log.info("replica %s takes routing slot %d", replica_id.unique_id, slot)
            if slot is not None:
                self.state.report(slot, (replica.routing_stats or {}).get("running", 0))
            endpoint = (replica.replica_metadata or {}).get("kv_events_endpoint")
            if slot is not None and endpoint and slot not in self._followers:
                stop = self._followers[slot] = threading.Event()
                threading.Thread(
                    target=follow_events,
                    args=(self.state, slot, endpoint, stop),
                    name=f"radixserve-kv-events-{slot}",
                    daemon=True,
                ).start()

    def _release(self, replica_id: ReplicaID) -> None:
        slot = self._slots.pop(replica_id, None)
        if slot is None:
            return
        stop = self._followers.pop(slot, None)
        if stop is not None:
            stop.set()
        self.state.mark_down(slot)
        log.warning("replica %s is gone; its pages are forgotten", replica_id.unique_id)


def route_key(pending_request: PendingRequest | None) -> RouteKey | None:
    """The `RouteKey` a call carries as its first argument, if it does."""
    if pending_request is None or not pending_request.args:
        return None
    key = pending_request.args[0]
    # Duck-typed: Serve may hand the router a by-value copy of this module's classes.
    return key if isinstance(getattr(key, "input_ids", None), list) else None


# -- the ingress ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Frontend:
    """The part of an engine the HTTP routes use, without the model: tokenizer and limits."""

    tokenizer: object
    vocab_size: int
    max_context: int

    def prepare_request(self, prompt, sampling_params):
        return prepare_request(
            prompt, sampling_params, self.tokenizer, self.vocab_size, self.max_context
        )


class RemoteDispatcher(Dispatcher):
    """Prepares requests in the ingress and starts them on the replica the router picks."""

    def __init__(self, frontend: _Frontend, replicas: DeploymentHandle, attempts: int = 3):
        super().__init__(frontend, worker=None)
        self.replicas = replicas
        self.attempts = attempts

    async def start(
        self, request: Request, jobs: Sequence[tuple], grammar_param: str | None = None
    ) -> Group:
        parts = await self.prepare(request.state.request_id, jobs)
        key = RouteKey(parts[0].input_ids, await _session(request), _prompt_text(jobs[0][0]))
        if not key.prompt:
            key = RouteKey(key.input_ids, key.session, await self.off_thread(self._text, key))
        call = self.replicas.options(stream=True).generate
        failure: BaseException | None = None
        for _ in range(self.attempts):
            stream = call.remote(key, parts, grammar_param)
            try:
                first = await stream.__anext__()
            except _REPLICA_GONE as exc:  # it died before taking the request: try another
                failure = exc
                log.warning("a replica went away before starting a request (%r)", exc)
                continue
            if first[0] == "error":
                raise APIError(*first[1:])
            return Group(
                request,
                [p.rid for p in parts],
                _remote_batches(stream),
                lambda rids, message, stream=stream: stream.cancel(),
            )
        raise APIError(503, f"no replica could take the request ({failure!r})", code="no_replica")

    def _text(self, key: RouteKey) -> str:
        return self.engine.tokenizer.decode(key.input_ids, skip_special_tokens=False)


async def _remote_batches(stream) -> AsyncIterator[list]:
    try:
        async for batch in stream:
            yield batch
    except _REPLICA_GONE as exc:
        dead = EngineDeadError(f"the replica serving this request died ({type(exc).__name__})")
        yield [(0, dead)]


async def _session(request: Request) -> str | None:
    session = request.headers.get("x-session-id")
    if session is None:
        try:
            body = await request.json()
        except ValueError:
            return None
        session = body.get("user") if isinstance(body, dict) else None
    return session if isinstance(session, str) else None


def _prompt_text(prompt) -> str:
    return prompt if isinstance(prompt, str) else ""


class Ingress:
    """The HTTP front of the application, built when its replica starts."""

    def __init__(
        self,
        replicas: DeploymentHandle,
        model: str | None,
        served_model_name: str | None = None,
        api_key: str | None = None,
        max_body_bytes: int | None = None,
    ) -> None:
        self.replicas = replicas
        self.model = model
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __serve_build_asgi_app__(self) -> FastAPI:
        from radixserve.model.loader import load_tokenizer
        from radixserve.server.app import MAX_BODY_BYTES, add_guards
        from radixserve.server.native import add_native_routes
        from radixserve.server.openai_api import add_openai_routes

        # A non-empty prompt: Ray's PrefixCacheAffinityRouter divides by its length.
        info = await self.replicas.describe.remote(RouteKey([], prompt="describe"))
        tokenizer = await asyncio.to_thread(load_tokenizer, self.model)
        frontend = _Frontend(tokenizer, info["vocab_size"], info["max_context"])
        model_name = self.served_model_name or info["model_name"]
        dispatcher = RemoteDispatcher(frontend, self.replicas)
        app = FastAPI(title="radixserve on Ray Serve")
        add_guards(app, self.api_key, self.max_body_bytes or MAX_BODY_BYTES, lambda: None)
        add_openai_routes(app, frontend, dispatcher, model_name, int(time.time()))
        add_native_routes(app, dispatcher)

        @app.get("/health")
        async def health():
            return JSONResponse({"status": "ok", "model": model_name})

        return app


# -- building and running ---------------------------------------------------------------------


def build_app(
    engine_options: dict,
    replicas: int,
    policy: str = "precise",
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queued_requests: int = 1024,
    request_timeout: float | None = None,
    watchdog: float | None = 60.0,
    replica_cpus: float = 1.0,
    events_timeout: float = 10.0,
    stats_period: float = 1.0,
    router_class: type | str = "radixserve.router.ray_serve.RadixRequestRouter",
    router_kwargs: dict | None = None,
):
    """The Serve application: `replicas` engines built from `engine_options` (`EngineConfig`
    fields), routed by `policy`, behind one ingress. `router_class`/`router_kwargs` swap in
    another Serve request router (a benchmark's peer)."""
    from radixserve.sched.routing import ROUTING_POLICIES

    if not isinstance(replicas, int) or replicas < 1:
        raise InvalidArgumentError(f"replicas must be an integer >= 1, got {replicas!r}")
    if policy not in ROUTING_POLICIES:
        raise InvalidArgumentError(
            f"router must be one of {sorted(ROUTING_POLICIES)}, got {policy!r}", field="router"
        )
    if router_kwargs is None:
        router_kwargs = {
            "policy": policy,
            "replicas": replicas,
            "page_size": engine_options.get("page_size") or 1,
            "events_timeout": events_timeout,
        }
    router_config = RequestRouterConfig(
        request_router_class=router_class,
        request_router_kwargs=router_kwargs,
        request_routing_stats_period_s=stats_period,
    )
    engines = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        num_replicas=replicas,
        max_ongoing_requests=max_queued_requests,
        request_router_config=router_config,
        ray_actor_options={"num_cpus": replica_cpus},
        health_check_period_s=2.0,
        health_check_timeout_s=max(30.0, watchdog or 0.0),
    ).bind(
        engine_options,
        max_queued_requests,
        request_timeout,
        watchdog,
        True,
    )
    ingress = serve.deployment(
        serve.ingress()(Ingress),
        name="Ingress",
        num_replicas=1,
        max_ongoing_requests=max_queued_requests,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(engines, engine_options.get("model"), served_model_name, api_key, None)


def run_cluster(
    app,
    host: str,
    port: int,
    ray_address: str | None,
    announce: str,
    ready_timeout: float = 600.0,
) -> int:
    """Start (or join, with `ray_address`) a Ray cluster, run `app` on Serve's HTTP proxy at
    host:port, print `announce` once every replica is up, and serve until SIGINT/SIGTERM."""
    if ray_address is None:
        ray.init(include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=ray_address, log_to_driver=False)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        wait_running(ready_timeout)
        print(announce, flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
        log.info("shutting down the Serve application")
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()


def wait_running(timeout: float) -> None:
    """Return once the application runs; raise if it failed to deploy or took `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = serve.status().applications.get(APP_NAME)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"the Serve application failed to deploy: {status.message}")
        time.sleep(0.5)
    raise TimeoutError(f"the Serve application was not running after {timeout:g} s")

"""The OpenAI-compatible HTTP endpoint: a Ray Serve deployment whose FastAPI ingress
forwards to the specray driver actor (found by name), which stays the one scheduling
point however many ingress replicas run.

Every request, streamed or not, is read the same way: a replica's ``DeltaPump`` asks the
driver for the new output of all its open requests in one call (``poll_many``), so a
chunk carries whatever tokens arrived since the last one and the cost of a call is shared
by every stream. A client that goes away aborts its requests in the driver, which frees
their KV blocks before its next step.

A driver that dies is restarted by Ray; the pump knows what each open request has
received, and resubmits it to the new driver from there (``specray.runtime.driver.resume``):
streams ride through with nothing lost or repeated, a non-streaming request completes.
Only a driver that does not serve again within ``RESTART_S`` ends them (an error chunk,
or a 503 before a non-streaming response's first byte).

Before a request is read it passes the server's doors (``specray.runtime.entrypoints.openai.guard``:
Host, API key, Content-Type, body size). A failure on the server's side reaches the
client as a generic message with a short error id; what failed, with that id, goes to
this module's log (``specray.http``, in the replica's log): a worker's traceback or
another request's error is never sent to a client.

``start_http`` deploys it on the Ray this process is connected to.
"""

import asyncio
import contextvars
import json
import logging
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from specray.runtime.driver.restarts import DRIVER_RESTART_TIMEOUT_S, died_for_good
from specray.runtime.driver.resume import InFlight
from specray.runtime.entrypoints.openai import protocol as api
from specray.runtime.entrypoints.openai.guard import Doors

log = logging.getLogger("specray.http")

POLL_S = 0.05          # a poll returns at the first step with news; this bounds a newcomer's wait
UNAVAILABLE_S = 30.0   # a request waits this long for a driver that stopped answering
RETRY_S = 0.5          # the pump's pause before asking a driver that failed to answer again
RESTART_S = DRIVER_RESTART_TIMEOUT_S   # open requests wait this long for a restarted driver
DEPLOYMENT = "SpecrayIngress"

app = FastAPI(title="specray", docs_url=None, redoc_url=None)


def _actor_errors() -> tuple[type, ...]:
    from ray import exceptions as rex

    return tuple(getattr(rex, n) for n in ("RayActorError", "ActorUnavailableError", "ActorDiedError",
                                           "GetTimeoutError") if hasattr(rex, n))


def detached(fn, *args):
    """``fn(*args)`` in an empty context: a Ray call made there, or a task created there,
    is no child of the request being served (see ``DeltaPump.open``)."""
    return contextvars.Context().run(fn, *args)


class DeltaPump:
    """One replica's reader of the driver: a queue per open request, filled by a single
    task that polls the driver for all of them at once."""

    def __init__(self, driver) -> None:
        self.driver = driver
        self.queues: dict[str, asyncio.Queue] = {}
        self.flight = InFlight()        # what each open request has received, to resume it
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    def open(self, request_ids: list[str], prompts: list | None = None, params: list | None = None,
             seeds: list[int] | None = None) -> dict[str, asyncio.Queue]:
        """Queues for these requests; with their prompts, params and the driver's seeds
        they are resumed on a restarted driver (else a lost driver ends them)."""
        if prompts is not None:
            self.flight.add(request_ids, prompts, params, seeds)
        qs = {rid: asyncio.Queue() for rid in request_ids}
        self.queues.update(qs)
        self._wake.set()
        if self._task is None or self._task.done():
            # Outside the calling request's context: Ray keys an async actor's calls to the
            # request task they are made in, and Serve cancels a departed client's request
            # with all its calls, which would take the pump's poll of every stream with it.
            self._task = detached(asyncio.get_running_loop().create_task, self._run())
        return qs

    def close(self, request_ids: list[str]) -> list[str]:
        """Stop reading these requests; returns the ids the driver knows them by now."""
        current = [t.driver_id if (t := self.flight.get(rid)) is not None else rid for rid in request_ids]
        self.flight.forget(request_ids)
        for rid in request_ids:
            self.queues.pop(rid, None)
        return current

    async def _run(self) -> None:
        errors = _actor_errors()
        while True:
            if not self.queues:
                self._wake.clear()
                await self._wake.wait()
                continue
            ids = list(self.queues)
            by_driver_id = {(t.driver_id if (t := self.flight.get(rid)) is not None else rid): rid for rid in ids}
            try:
                reply = await self.driver.poll_many.remote(list(by_driver_id), POLL_S)
            except errors as e:
                await self._lost(ids, type(e).__name__)
                continue
            except Exception as e:  # noqa: BLE001 - a pump that dies would hang every stream
                for rid in ids:
                    self._put(rid, ("error", f"{type(e).__name__}: {e}"))
                continue
            for d in reply.deltas:
                rid = by_driver_id.get(d.request_id)
                if rid is None or (self.flight.get(rid) is not None
                                   and not self.flight.received(rid, d.request_id, d, delta=True)):
                    continue        # from a driver id the request has moved away from: sent again
                d.request_id = rid
                self._put(rid, ("delta", d))
            for did, why in reply.errors.items():
                self._put(by_driver_id[did], ("error", why))
            restarted = False
            for did in reply.unknown:
                rid = by_driver_id[did]
                if self.flight.get(rid) is not None:
                    restarted = True            # the driver restarted since it took the request
                else:
                    self._put(rid, ("error", "the driver no longer holds this request"))
            if restarted:
                await self._lost(ids, "the driver restarted")

    async def _lost(self, ids: list[str], why: str) -> None:
        """The driver failed under a poll: requests that cannot be resumed end now; the
        rest are resubmitted, each from what it received, once the driver serves again,
        or end once ``RESTART_S`` has passed."""
        for rid in ids:
            if self.flight.get(rid) is None:
                self._put(rid, ("unavailable", f"the specray driver is unavailable: {why}"))
        errors = _actor_errors() + (asyncio.TimeoutError,)
        deadline = time.monotonic() + RESTART_S
        while True:
            tracked, prompts, params, resumes = self.flight.resubmissions()
            if not tracked:
                await asyncio.sleep(RETRY_S)
                return
            try:
                await asyncio.wait_for(self.driver.info.remote(), max(0.1, deadline - time.monotonic()))
                await self.driver.abort.remote([t.driver_id for t in tracked])   # a driver only out of reach
                reply = await self.driver.submit.remote(prompts, params, resumes)
            except errors as e:
                why = type(e).__name__
                if died_for_good(self.driver, e) or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(RETRY_S)
                continue
            except Exception as e:  # noqa: BLE001 - a pump that dies would hang every stream
                why = f"{type(e).__name__}: {e}"
                break
            if reply.error:
                why = f"the restarted driver refused to resume them: {reply.error}"
                break
            self.flight.moved(tracked, reply.request_ids)
            return
        for t in tracked:
            self._put(t.request_id, ("unavailable", f"the specray driver did not serve again ({why})"))
        self.flight.forget([t.request_id for t in tracked])

    def _put(self, rid: str, item) -> None:
        q = self.queues.get(rid)
        if q is not None:
            q.put_nowait(item)


class _Metrics:
    def __init__(self) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        self.requests = Counter("specray_http_requests_total", description="HTTP requests answered, by route "
                                "and status", tag_keys=("route", "status"))
        self.in_flight = Gauge("specray_http_requests_in_flight", description="HTTP requests being answered",
                               tag_keys=("route",))
        self.latency = Histogram("specray_http_request_duration_s", description="HTTP request time to its last byte",
                                 boundaries=[0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60], tag_keys=("route",))
        self.tokens = Counter("specray_http_completion_tokens_total", description="tokens sent over HTTP",
                              tag_keys=("route",))
        self._open: dict[str, int] = {}

    def begin(self, route: str) -> float:
        self._open[route] = self._open.get(route, 0) + 1
        self.in_flight.set(self._open[route], tags={"route": route})
        return time.monotonic()

    def end(self, route: str, status: int, t0: float, tokens: int = 0) -> None:
        self._open[route] -= 1
        self.in_flight.set(self._open[route], tags={"route": route})
        self.requests.inc(1, tags={"route": route, "status": str(status)})
        self.latency.observe(time.monotonic() - t0, tags={"route": route})
        if tokens:
            self.tokens.inc(tokens, tags={"route": route})


async def _forward(i: int, q: asyncio.Queue, out: asyncio.Queue) -> None:
    while True:
        item = await q.get()
        out.put_nowait((i, item))
        if item[0] != "delta" or item[1].finished:
            return


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


class _Json(JSONResponse):
    """JSON in ASCII, as the stream's chunks are: a lone surrogate (valid in a JSON string
    a client sent) cannot be encoded as UTF-8, so one that reached an answer would make it
    a 500."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def _error_response(e: api.ApiError) -> JSONResponse:
    headers = {"Retry-After": str(max(1, round(e.retry_after_s)))} if e.retry_after_s else {}
    if e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return _Json(e.body(), status_code=e.status, headers=headers or None)


def failure(status: int, detail: str, exc_info: BaseException | None = None) -> api.ApiError:
    """A failure on the server's side: logged in full under a fresh error id; the client
    is told only that it failed, and the id."""
    eid = secrets.token_hex(4)
    log.error("error id %s (HTTP %d): %s", eid, status, detail, exc_info=exc_info)
    if status == 503:
        message = f"the specray driver is unavailable; retry shortly (error id {eid})"
    else:
        message = f"the server failed to complete this request (error id {eid})"
    return api.ApiError(status, message, retry_after_s=1 if status == 503 else None)


class OpenAIIngress:
    """The routes; ``Ingress`` is this class as a Serve deployment."""

    def __init__(self, driver_name: str, namespace: str, served_model_name: str, doors: Doors | None = None) -> None:
        import ray

        self.driver = ray.get_actor(driver_name, namespace=namespace)
        info = ray.get(self.driver.info.remote(), timeout=120)
        self.served = served_model_name
        self.max_model_len = info.max_model_len
        self.has_chat_template = info.has_chat_template
        # More choices than the driver holds could never be admitted: refused whole, up front.
        self.max_choices = info.config.max_pending
        self.doors = doors if doors is not None else Doors()
        self.created = int(time.time())
        self.pump = DeltaPump(self.driver)
        self.names: dict[int, str] = {}        # token id -> its text, for log-probabilities
        self.metrics = _Metrics()

    # -- routes --------------------------------------------------------------------
    @app.get("/health")
    async def health(self):
        try:
            await asyncio.wait_for(self.driver.info.remote(), timeout=5)
        except Exception as e:  # noqa: BLE001 - any failure is "not healthy"
            return JSONResponse({"status": "unavailable", "reason": type(e).__name__}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(self, request: Request):
        try:
            self._pass_doors(request)
        except api.ApiError as e:
            return _error_response(e)
        return {"object": "list", "data": [{"id": self.served, "object": "model", "created": self.created,
                                            "owned_by": "specray", "max_model_len": self.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._generate(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._generate(request, "chat")

    # -- one request ---------------------------------------------------------------
    def _pass_doors(self, request: Request) -> None:
        self.doors.check_host(request.headers.get("host"))
        self.doors.check_key(request.headers.get("authorization"))

    async def _generate(self, request: Request, route: str):
        t0 = self.metrics.begin(route)
        try:
            self._pass_doors(request)
            self.doors.check_json(request.headers.get("content-type"))
            req = await self._parse(request, route)
            reply = await self._submit(req)
        except api.ApiError as e:
            self.metrics.end(route, e.status, t0)
            return _error_response(e)
        except Exception as e:  # noqa: BLE001 - any other failure is the server's, told generically
            err = failure(500, f"{route}: {type(e).__name__}: {e}", e)
            self.metrics.end(route, err.status, t0)
            return _error_response(err)
        ids = reply.request_ids
        queues = self.pump.open(ids, req.prompts, req.params, reply.seeds)
        if req.stream:
            return StreamingResponse(self._stream(req, ids, queues, route, t0), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        status, tokens = 500, 0
        try:
            choices = [api.Choice(i) for i in range(len(ids))]
            for i, rid in enumerate(ids):
                while choices[i].finish_reason is None:
                    kind, item = await queues[rid].get()
                    if kind != "delta":
                        raise failure(503 if kind == "unavailable" else 500, f"{req.id} choice {i}: {item}")
                    choices[i].add(item)
            names = await self._names([e for c in choices for e in c.logprobs])
            status, tokens = 200, sum(len(c.token_ids) for c in choices)
            return _Json(api.response(req, choices, names))
        except api.ApiError as e:
            status = e.status
            return _error_response(e)
        except Exception as e:  # noqa: BLE001 - any other failure is the server's, told generically
            err = failure(500, f"{req.id}: {type(e).__name__}: {e}", e)
            status = err.status
            return _error_response(err)
        finally:
            # Reached on success too, and when the client went away (the task is cancelled):
            # requests still running are aborted, freeing their blocks.
            current = self.pump.close(ids)
            if status != 200:
                self._abort(current)
            self.metrics.end(route, status, t0, tokens)

    async def _parse(self, request: Request, route: str) -> api.GenerationRequest:
        raw = await self.doors.read_body(request)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):     # bad JSON or UTF-8, a huge number, nesting past the stack
            raise api.bad("the request body is not valid JSON") from None
        if route == "chat":
            if not self.has_chat_template:
                raise api.bad("the served model has no chat template; use /v1/completions", "messages")
            return api.parse_chat(body, self.served, self.max_model_len, self.max_choices)
        return api.parse_completion(body, self.served, self.max_model_len, self.max_choices)

    async def _submit(self, req: api.GenerationRequest):
        from ray.exceptions import ActorUnavailableError

        deadline = time.monotonic() + UNAVAILABLE_S
        while True:
            try:
                reply = await asyncio.wait_for(self.driver.submit.remote(req.prompts, req.params),
                                               max(0.1, deadline - time.monotonic()))
                break
            except (asyncio.TimeoutError, *_actor_errors()) as e:
                # Died under the call and being restarted: what it took died with it, so
                # submitting again to the new one repeats nothing.
                if isinstance(e, ActorUnavailableError) and time.monotonic() < deadline:
                    await asyncio.sleep(RETRY_S)
                    continue
                raise failure(503, f"submit: {type(e).__name__}: {e}") from None
        if reply.overloaded:
            raise api.ApiError(429, reply.error, retry_after_s=1)
        if reply.error:
            if reply.error == "the runtime is shut down":
                raise failure(503, f"submit: {reply.error}")
            message = reply.error
            if req.num_choices == 1 and message.startswith("request 0: "):
                message = message[len("request 0: "):]
            raise api.bad(message, "prompt" if "prompt" in message else None)
        return reply

    async def _stream(self, req: api.GenerationRequest, ids: list[str], queues: dict, route: str, t0: float):
        choices = [api.Choice(i) for i in range(len(ids))]
        sent = [0] * len(ids)
        first = [True] * len(ids)
        merged: asyncio.Queue = asyncio.Queue()
        # One reader per choice moves its queue into one, so chunks go out as they come.
        readers = [asyncio.get_running_loop().create_task(_forward(i, queues[rid], merged))
                   for i, rid in enumerate(ids)]
        status, left = 200, len(ids)
        try:
            try:
                while left:
                    i, (kind, item) = await merged.get()
                    if kind != "delta":
                        err = failure(503 if kind == "unavailable" else 500, f"{req.id} choice {i}: {item}")
                        status = err.status
                        yield _sse(err.body())
                        break
                    c = choices[i]
                    c.add(item)
                    if not (item.text or item.finished or item.token_ids and req.logprobs is not None):
                        continue
                    names = await self._names(getattr(item, "logprobs", None) or [])
                    yield _sse(api.chunk(req, c, item, names, first[i], sent[i]))
                    first[i] = False
                    sent[i] += len(item.text)
                    if item.finished:
                        left -= 1
            except Exception as e:  # noqa: BLE001 - the headers are out: the failure is told as a chunk
                err = failure(500, f"{req.id}: {type(e).__name__}: {e}", e)
                status = err.status
                yield _sse(err.body())
            if status == 200 and req.include_usage:
                yield _sse(api.usage_chunk(req, choices))
            yield "data: [DONE]\n\n"
        finally:
            for r in readers:
                r.cancel()
            current = self.pump.close(ids)
            if left:
                status = status if status != 200 else 499      # the client went away
                self._abort(current)
            self.metrics.end(route, status, t0, sum(len(c.token_ids) for c in choices))

    def _abort(self, ids: list[str]) -> None:
        # Sent, not awaited: this runs while the request's task is being cancelled, and
        # detached from it, or Serve's cancelling of the request cancels the abort too.
        try:
            detached(self.driver.abort.remote, ids)
        except Exception as e:  # noqa: BLE001 - the driver may be gone; nothing else to free
            log.warning("abort of %d requests failed: %s", len(ids), e)

    async def _names(self, entries: list) -> dict[int, str]:
        if not entries:
            return self.names
        missing = sorted(api.token_ids_named(entries) - self.names.keys())
        if missing:
            texts = await self.driver.decode_tokens.remote(missing)
            self.names.update(zip(missing, texts))
        return self.names


Ingress = serve.deployment(name=DEPLOYMENT, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})(
    serve.ingress(app)(OpenAIIngress))


def build_app(driver_name: str, namespace: str, served_model_name: str, replicas: tuple[int, int] = (1, 1),
              doors: Doors | None = None):
    """The Serve application; ``replicas`` (min, max) autoscale the ingress when they differ.
    ``doors`` (the API key among them) reach every replica as a deployment argument."""
    lo, hi = replicas
    if lo == hi:
        dep = Ingress.options(num_replicas=lo)
    else:
        dep = Ingress.options(autoscaling_config={"min_replicas": lo, "max_replicas": hi,
                                                  "target_ongoing_requests": 32})
    return dep.bind(driver_name, namespace, served_model_name, doors)


def start_http(driver_name: str, namespace: str, served_model_name: str, host: str = "127.0.0.1",
               port: int = 8000, replicas: tuple[int, int] = (1, 1), app_name: str = "specray",
               health_timeout_s: float = 120.0, doors: Doors | None = None) -> str:
    """Deploy the endpoint beside a running driver; returns its base URL once ``/health``
    answers 200. ``doors`` default to ``Doors.build(host, port)``: the bound address and
    loopback names, no API key, the default body cap."""
    import urllib.error
    import urllib.request

    doors = doors if doors is not None else Doors.build(host, port)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(driver_name, namespace, served_model_name, replicas, doors), name=app_name,
              route_prefix="/", blocking=False)
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + health_timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return url
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the HTTP endpoint at {url} did not become healthy within {health_timeout_s:g} s")
        time.sleep(0.2)


def stop_http(app_name: str = "specray") -> None:
    serve.delete(app_name)
    serve.shutdown()

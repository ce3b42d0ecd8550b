"""The judge client for reward code, over relay (ZeroMQ):

    from reward.client import get_genrm_client
    client = get_genrm_client()          # address from RELAY_GENRM_ADDR (set by the launcher)
    text = await client.generate(messages, sampling_params=None, route_key=None)
    texts = await client.generate_many([messages_a, messages_b])

One client per process and event loop (``get_genrm_client`` caches it). Errors are typed:
:class:`~reward.errors.JudgeAsleep` at once while the judge sleeps (no waiting on a sleeping
judge), ``ValueError`` / :class:`~reward.errors.UnknownRouteKey` for bad requests (never
retried), :class:`~reward.errors.JudgeEngineError` when engine steps failed the request in
all the service's attempts (3, with backoff; not retried again here),
:class:`~reward.errors.JudgeUnavailable` after bounded retries of transport failures.
Cancelling a call (its task) cancels the request in the service and in its engine. Outside
a job, pass ``address`` and give the process the judge's secret (``RELAY_JOB_SECRET``, or
``RELAY_JOB_SECRET_FILE`` naming the file ``relay judge`` printed). The original's
``get_genrm_client(service_url="http://.../genrm")`` gives the HTTP client
(reward/http_client.py), with the same calls.

The first call proves the secret with relay's authenticated handshake
(``ProcMesh.authenticate``): a wrong or missing secret raises
:class:`relay.AuthenticationError`, which says what to set, within seconds (not after the
call timeout); it is never retried.

Calls made in the same event-loop turn (concurrent reward coroutines, ``generate_many``)
travel to the service as one relay message (:class:`JudgeBatcher`); each call still gets
its own result, error and timeout. A call's default timeout is 1800 s (as the original's).

``client.health_check()`` and ``client.get_metrics()`` are synchronous, as the original's,
and never raise: the health shape of ``GET /genrm/health`` or ``{"status": "unhealthy",
"error": ...}``, the JSON of ``GET /genrm/metrics`` (the judge's part: ``service``, the
instances' ``model_path``, ``num_gpus``, ``num_engines`` and counters) or ``{}``. They block
their thread, so from a coroutine on the client's event loop use ``await
client.health_check_async()`` / ``await client.get_metrics_async()`` (the same answers);
called on that loop's thread, the synchronous ones ask the job's HTTP gateway
(``RELAY_GENRM_URL``, set by the launcher) with one blocking request, as the original's
HTTP client does; without it they cannot wait and say so in ``error`` (or return ``{}``).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid

from engines.interface import SamplingParams
from relay import ActorError, AuthenticationError, CallTimeout, ProcMesh, ProcRef, SupervisionError
from reward.settings import settings as reward_settings

from .errors import JudgeAsleep, JudgeEngineError, JudgeUnavailable
from .http_client import gather_all
from .judge import JudgeService
from .protocol import check_request, health_body, metrics_body

ENV_ADDR = "RELAY_GENRM_ADDR"
ENV_ACTOR = "RELAY_GENRM_ACTOR"
MAX_BATCH = 256  # judge requests per relay message to the service
CALL_TIMEOUT = 1800.0  # seconds: a judge call's default timeout (the original's)
STATUS_TIMEOUT = 10.0  # seconds: health_check / get_metrics


class JudgeBatcher:
    """Coalesces judge requests to one JudgeService mesh: the requests submitted during one
    event-loop turn with the same timeout go out at its end as one ``generate_batch`` call
    (up to ``MAX_BATCH``), whose timeout is theirs.

    Each request's future gets its own outcome, as a lone ``generate.call_one`` would give
    it: the response text; :class:`ActorError` wrapping the exception the service raised for
    that request; or, when the relay call itself fails, that failure (SupervisionError,
    CallTimeout) for every request of the call.
    """

    def __init__(self, mesh):
        self._mesh = mesh
        self._queues: dict[float, list] = {}  # timeout -> [(request, future)] of this loop turn
        self._prefix = uuid.uuid4().hex[:12] + ":"  # request ids unique across clients
        self._ids = itertools.count()
        self._cancelled: list = []  # ids of sent requests whose callers gave up, this loop turn

    def call(self, messages, sampling_params, route_key, timeout: float) -> asyncio.Future:
        """The future of one request's outcome. Cancelling it (its caller gave up, or was
        cancelled) cancels the request in the service and its engine."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        queue = self._queues.get(timeout)
        if queue is None:
            queue = self._queues[timeout] = []
            if len(self._queues) == 1:
                loop.call_soon(self._flush)
        queue.append(([messages, sampling_params, route_key, f"{self._prefix}{next(self._ids):x}"], fut))
        return fut

    def _flush(self) -> None:
        queues, self._queues = self._queues, {}
        loop = asyncio.get_running_loop()
        for timeout, queue in queues.items():
            queue = [(req, f) for req, f in queue if not f.done()]  # cancelled before they went out
            for k in range(0, len(queue), MAX_BATCH):
                loop.create_task(self._send(queue[k : k + MAX_BATCH], timeout))

    def _cancel(self, request_id: str) -> None:
        if not self._cancelled:
            asyncio.get_running_loop().call_soon(self._send_cancels)
        self._cancelled.append(request_id)

    def _send_cancels(self) -> None:
        ids, self._cancelled = self._cancelled, []
        self._mesh.cancel.broadcast(ids)  # fire and forget

    async def _send(self, batch: list, timeout: float) -> None:
        futures = [f for _, f in batch]
        for req, fut in batch:
            fut.add_done_callback(lambda f, rid=req[3]: self._cancel(rid) if f.cancelled() else None)
        try:
            results = await self._mesh.generate_batch.call_one([req for req, _ in batch]).result(timeout)
            if len(results) != len(futures):
                raise ValueError(f"the judge service answered {len(results)} results for {len(futures)} requests")
        except BaseException as e:  # noqa: BLE001 - the call itself failed: every request gets it
            if isinstance(e, CallTimeout):  # nobody waits for them any more
                for req, fut in batch:
                    if not fut.done():
                        self._cancel(req[3])
            for fut in futures:
                if not fut.done():
                    fut.set_exception(e)
            return
        for fut, r in zip(futures, results):
            if fut.done():
                continue
            if isinstance(r, BaseException):  # that request's own error, as a lone call raises it
                fut.set_exception(ActorError("genrm", 0, "generate", r, getattr(r, "remote_traceback", "")))
            else:
                fut.set_result(r)


class GenRMClient:
    def __init__(
        self,
        address: str,
        actor: str = "genrm",
        timeout: float = CALL_TIMEOUT,
        retries: int = 2,
        auth_timeout: float = 5.0,
    ):
        self.address = address
        self.timeout = timeout
        self.retries = retries
        self.auth_timeout = auth_timeout
        self._procs = ProcMesh.attach([ProcRef("genrm", address, "genrm", 0)], name="genrm")
        self._mesh = self._procs.actors(actor, JudgeService)
        self._batcher = JudgeBatcher(self._mesh)
        self._authenticated = False
        self._auth: asyncio.Future | None = None  # the handshake in progress, shared by concurrent calls

    async def _authenticate(self) -> None:
        """One handshake for all calls waiting on it; a failed one is tried again by the next call."""
        if self._auth is None:
            self._auth = asyncio.ensure_future(self._handshake())
        auth = self._auth
        try:
            await asyncio.shield(auth)
        finally:
            if auth.done() and self._auth is auth and (auth.cancelled() or auth.exception() is not None):
                self._auth = None

    async def _handshake(self) -> None:
        try:
            await self._procs.authenticate(self.auth_timeout)
        except AuthenticationError as e:
            raise AuthenticationError(
                e.addr,
                f"judge client: {e} `relay judge` prints the file that holds its secret: use "
                f"RELAY_JOB_SECRET_FILE=<that file>.",
            ) from None
        self._authenticated = True

    async def generate(
        self,
        messages: list,
        sampling_params: dict | None = None,
        route_key: str | None = None,
        timeout: float | None = None,
    ) -> str:
        # a bad request fails this call alone, here, before it is batched with other calls
        # (an integer past 64 bits, or nesting deeper than msgpack packs, would make the whole
        # batch's message unsendable); content parts are joined here
        messages = check_request(messages, sampling_params, route_key)[0]
        SamplingParams.from_dict(sampling_params)
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                if not self._authenticated:
                    await self._authenticate()
                return await self._batcher.call(messages, sampling_params, route_key, timeout or self.timeout)
            except ActorError as e:
                if isinstance(e.exception, JudgeUnavailable):
                    last = e.exception
                elif isinstance(e.exception, (JudgeAsleep, JudgeEngineError, ValueError, TypeError)):
                    raise e.exception from None
                else:
                    raise
            except (SupervisionError, CallTimeout) as e:
                last = e
            await asyncio.sleep(0.5 * (attempt + 1))
        raise JudgeUnavailable(f"judge at {self.address} failed {self.retries + 1} times: {last}")

    async def health_check_async(self) -> dict:
        """The judge's health as ``GET /genrm/health`` gives it, or ``{"status": "unhealthy",
        "service": "genrm", "error": ...}``; never raises."""
        try:
            if not self._authenticated:
                await self._authenticate()
            return health_body(await self._mesh.health.call_one().result(STATUS_TIMEOUT))
        except Exception as e:  # noqa: BLE001 - reported, never raised
            return {"status": "unhealthy", "service": "genrm", "error": f"{type(e).__name__}: {e}"}

    async def get_metrics_async(self) -> dict:
        """The judge's metrics as ``GET /genrm/metrics`` gives them (without the HTTP
        gateway's own counters), or ``{}``; never raises."""
        try:
            if not self._authenticated:
                await self._authenticate()
            return metrics_body(await self._mesh.metrics_snapshot.call_one().result(STATUS_TIMEOUT))
        except Exception:  # noqa: BLE001 - {} on any failure, as the original
            return {}

    def health_check(self) -> dict:
        """Synchronous :meth:`health_check_async` (the original's call); never raises. On the
        client's own event-loop thread (which cannot wait for itself): through the job's
        HTTP gateway."""
        gateway = self._gateway_on_loop_thread()
        if gateway is not None:
            return gateway.health_check()
        try:
            return self._blocking(self.health_check_async())
        except Exception as e:  # noqa: BLE001
            return {"status": "unhealthy", "service": "genrm", "error": f"{type(e).__name__}: {e}"}

    def get_metrics(self) -> dict:
        """Synchronous :meth:`get_metrics_async` (the original's call); never raises."""
        gateway = self._gateway_on_loop_thread()
        if gateway is not None:
            return gateway.get_metrics()
        try:
            return self._blocking(self.get_metrics_async())
        except Exception:  # noqa: BLE001
            return {}

    def _gateway_on_loop_thread(self):
        """The job's HTTP gateway client (``RELAY_GENRM_URL``) when called on the client's own
        event-loop thread, which cannot wait for a relay answer; else None."""
        rt = self._procs._rt
        if not (rt.loop.is_running() and rt.in_loop_thread() and reward_settings().genrm_url):
            return None
        from .http_client import HTTPGenRMClient

        return HTTPGenRMClient(reward_settings().genrm_url)

    def _blocking(self, coro):
        """Run ``coro`` on the event loop of the client's relay runtime and wait for it."""
        rt = self._procs._rt
        if rt.loop.is_running():
            if rt.in_loop_thread():
                coro.close()
                raise RuntimeError("called on the event loop's thread: use 'await client.health_check_async()'")
            return asyncio.run_coroutine_threadsafe(coro, rt.loop).result(STATUS_TIMEOUT + 10)
        return rt.loop.run_until_complete(coro)

    def report_parse(self, route_key: str | None, ok: bool) -> None:
        """Tell the service whether a verdict could be read (fire and forget; feeds the
        parse-failure rate in its metrics)."""
        self._mesh.record_parse.broadcast(route_key, ok)

    async def generate_many(
        self, list_of_messages: list, sampling_params: dict | None = None, route_key: str | None = None
    ) -> list[str]:
        return await gather_all([self.generate(m, sampling_params, route_key) for m in list_of_messages])



_clients: dict = {}


def get_genrm_client(address: str | None = None, actor: str | None = None, *, service_url: str | None = None,
                     timeout: float | None = None):
    """The client of this process and event loop (created on first use). ``address``: the
    judge service's relay address (default ``RELAY_GENRM_ADDR``, set inside a job). An HTTP
    URL (``service_url=``, the original's name, or an ``http(s)://`` address) gives the
    HTTP client (reward/http_client.py) with the same calls. ``timeout``: a call's default
    (1800 s)."""
    url = service_url or (address if address and address.startswith(("http://", "https://")) else None)
    if url is not None:
        from .http_client import HTTPGenRMClient

        key = (os.getpid(), url, timeout)
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = HTTPGenRMClient(url, timeout or CALL_TIMEOUT)
        return client
    address = address or reward_settings().genrm_addr
    if not address:
        raise RuntimeError(f"no judge address: pass address=... (or service_url='http://...') or run inside a job "
                           f"(which sets {ENV_ADDR})")
    if not address.startswith(("tcp://", "ipc://")):
        raise ValueError(f"judge address {address!r}: a relay address is tcp://HOST:PORT or ipc://PATH; for the "
                         "HTTP gateway pass service_url='http://HOST:PORT/genrm'")
    actor = actor or reward_settings().genrm_actor
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    key = (os.getpid(), id(loop), address, actor, timeout)
    client = _clients.get(key)
    if client is None:
        client = _clients[key] = GenRMClient(address, actor, timeout or CALL_TIMEOUT)
    return client

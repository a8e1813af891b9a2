"""The Gateway object: everything one gateway process keeps between requests.

It holds the routing snapshot and its refresher (gateway.state), the balancer with the load and
prefix maps it shares with the machine's other gateway processes, the pools of connections to
the engines and to the web process, the traffic book, the limit counters, the fair queue and the
metrics. Why an object rather than module globals (the way Starlette keeps `app.state`): the
lifespan makes it once a worker starts (gateway.app), a test or a second application in one
process can have one of its own, and stopping it closes everything it opened.
"""

from __future__ import annotations

import atexit
import gc
import logging
import shutil
import tempfile
from pathlib import Path

from django.conf import settings
from django.db import connection

from access import traffic
from catalog.config import current_config
from fleet.renewals import Receive, Renewals, Scope, Send

from . import accesslog, conf, errors, http, proxy
from .accesslog import AccessLog
from .fairqueue import FairQueue
from .limits import SharedCounters
from .load import SharedLoad
from .loadsignal import LoadSignalBook
from .metrics import EngineFigures, Metrics, metrics
from .prefix import PrefixTable
from .redislimits import RedisLimits
from .routing import Balancer
from .state import GatewayState
from .tracing import Tracer
from .webforward import Budget, Web

log = logging.getLogger("llmgw.gateway")


# The gateway workers' cyclic garbage collector: its youngest generation's threshold (see
# Gateway.started).
GC_YOUNG_OBJECTS = 100_000


class Gateway:
    """One gateway process's state, connection pools and figures.

    Made bare (in memory, nothing shared with other processes) for a process that did not
    start through the lifespan, or by `Gateway.started()` in a worker's lifespan: its maps on
    VAR_DIR, shared with the machine's other gateway processes, and its refresher running.
    """

    def __init__(
        self,
        *,
        state: GatewayState | None = None,
        balancer: Balancer | None = None,
        queue: FairQueue | None = None,
        counters: SharedCounters | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        # The process's one board of figures: Prometheus keeps one set of metrics a process.
        self.metrics: Metrics = metrics()
        self.state = (
            state if state is not None else GatewayState(traffic.TrafficBook(), self.metrics)
        )
        self.balancer = balancer if balancer is not None else Balancer()
        self.queue = queue if queue is not None else FairQueue(None)
        self.queue.on_depth = self._queue_depth
        self.queue.on_wait = self._queue_wait
        if counters is not None:
            self.state.counters = counters
        self.balancer.on_remembered = self.metrics.replica_names.set
        self.tracer = tracer if tracer is not None else Tracer()
        self.upstream = proxy.Upstream()
        # /metrics' figures of the engines and the control plane, read from the database at most
        # every CONTROL_PLANE_READ_SECONDS: (when read, the engines' figures, the control
        # plane's text).
        self.control_plane_read: tuple[float, tuple[EngineFigures, ...], bytes] | None = None
        self.web = Web()
        self.forward_budget = Budget(self.metrics)
        # Nodes' renewals answered here (fleet.renewals), through this process's door.
        self.renewals = Renewals(RenewalDoor(self.metrics))
        # One line per /v1/ request (gateway.relay._count): None writes none. A bare gateway
        # (a test's) writes none unless given one; Gateway.started makes the settings' one.
        self.access_log: AccessLog | None = None
        # The fair queue's figures for the autoscaler (fleet.autoscale): a bare gateway writes
        # none; Gateway.started makes one, which the state's refresher writes.
        self.load_signal: LoadSignalBook | None = None

    @property
    def book(self) -> traffic.TrafficBook:
        """The traffic figures requests leave; the state's refresher writes them."""
        return self.state.book

    @property
    def counters(self) -> SharedCounters:
        """The limit counters. A gateway that did not start from the lifespan (a test serving
        the application in a thread) counts in a folder of its own: sharing VAR_DIR's with
        unrelated processes, whose keys have the same ids in other databases, would count
        their requests as its own."""
        counters = self.state.counters
        if counters is None or counters.closed:
            folder = Path(tempfile.mkdtemp(prefix="llmgw-limits-"))
            counters = SharedCounters(folder, writer=self.book.writer)
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            self.state.counters = counters
        return counters

    @classmethod
    def started(cls) -> Gateway:
        """This worker process's gateway: the routing snapshot read, its refresher started,
        the load, prefix, limit and queue maps shared on VAR_DIR. Bad settings stop it here,
        not at its first request."""
        conf.wait_seconds(), conf.upstream_timeout(), conf.metrics_open(), conf.body_seconds()
        conf.max_head_bytes(), conf.max_headers(), conf.head_seconds(), conf.forward_memory_bytes()
        conf.max_connections(), conf.queue_timeout(), conf.queue_max(), conf.fair_queue_on()
        conf.queue_max_per_user(), conf.queue_max_per_key(), conf.limits_redis_url()
        conf.forward_reserve_bytes(), conf.forward_client_bytes(), conf.body_deadline()
        conf.body_min_rate(), conf.limits_redis_timeout(), conf.limits_redis_fallback()
        conf.access_log_format(), conf.access_log_file(), conf.access_log_max_bytes()
        conf.access_log_backups()
        current_config()  # and a server.yaml that does not validate (ConfigError)
        tracer = Tracer()
        tracer.start()  # when OTEL_EXPORTER_OTLP_ENDPOINT asks for traces
        book = traffic.TrafficBook()
        counters = SharedCounters(settings.VAR_DIR / "gateway-limits", writer=book.writer)
        gateway = cls(
            state=GatewayState(book, metrics()),
            tracer=tracer,
            balancer=Balancer(
                SharedLoad(settings.VAR_DIR / "gateway-load"),
                PrefixTable(settings.VAR_DIR / "gateway-prefix"),
            ),
            queue=FairQueue(settings.VAR_DIR / "gateway-queue"),
            counters=counters,
        )
        # Opened before any thread starts: a file it cannot write stops the start.
        gateway.access_log = accesslog.from_settings(gateway.metrics)
        gateway.load_signal = gateway.state.load_signal = LoadSignalBook(gateway.queue, book.writer)
        redis_url = conf.limits_redis_url()
        if redis_url:
            board = gateway.metrics
            counters.remote = RedisLimits(
                redis_url,
                on_error=board.limits_redis_errors.inc,
                on_drop=board.limits_redis_dropped.inc,
                on_down=lambda down: board.limits_redis_down.set(int(down)),
            )
        try:
            gateway.state.reload()
        finally:
            connection.close()  # this thread's: the refresher has its own
        gateway.state.start()
        if gateway.access_log is not None:
            gateway.access_log.start()  # its writer thread
        if conf.gc_freeze():
            tune_collector()
        return gateway

    def stop(self) -> None:
        """Write the access log's last lines, stop the refresher, write the last figures and
        close the shared maps."""
        if self.access_log is not None:
            try:
                self.access_log.close()  # after the last request: the lifespan's shutdown
            except Exception:
                log.exception("gateway: could not write the access log's last lines")
        self.state.stop()
        if self.load_signal is not None:
            try:
                self.load_signal.close()
            except Exception:
                log.exception("gateway: could not take its queue figures away")
        try:
            self.book.flush()  # the last seconds' figures
        except Exception:
            log.exception("gateway: could not write the last traffic figures")
        finally:
            connection.close()
        self.balancer.load.close()
        self.balancer.prefixes.close()
        self.queue.close()
        if self.state.counters is not None:
            # After the flush: until its file goes, the others count this process's tokens by it.
            self.state.counters.close()

    async def close_pools(self) -> None:
        await self.upstream.close()
        await self.web.close()

    def _queue_depth(self, model: str, depth: int) -> None:
        self.metrics.queue_depth.labels(model).set(depth)

    def _queue_wait(self, model: str, seconds: float, outcome: str) -> None:
        self.metrics.queue_seconds.labels(model, outcome).observe(seconds)
        # And in the traffic figures, for the model page and the API (a request that did not
        # queue is not written there).
        self.book.record_wait(model=model, seconds=seconds, outcome=outcome)
        if self.load_signal is not None:
            self.load_signal.wait(model, seconds, outcome)


class RenewalDoor:
    """What the gateway lends fleet's renewals (fleet.renewals.Door): its body reading and
    refusals, in the words every request gets, and its figures."""

    def __init__(self, figures: Metrics) -> None:
        self.figures = figures

    def header(self, scope: Scope, name: bytes) -> str:
        return http.header(scope, name)

    async def read_body(self, receive: Receive, send: Send, limit: int) -> bytes | None:
        try:
            return await http.read_body(receive, limit)
        except http.TooBig:
            await http.refuse(send, errors.too_large(limit))
        except http.Slow:
            await http.refuse(send, errors.too_slow(conf.body_seconds()))
        except http.Disconnected:
            pass
        return None

    async def answer(self, send: Send, status: int, body: bytes) -> None:
        await http.whole(send, status, body)

    async def busy(self, send: Send, retry_after: int) -> None:
        await http.refuse(send, errors.nodes_busy(retry_after))


def tune_collector() -> None:
    """What the start made (Django's modules and models, the first snapshot: about 200,000
    objects) is moved out of the cyclic collector's sight: a full collection went over all of
    it, 130-350 ms of the worker's GIL every 15-30 s at 5,000 nodes and 20,000 replicas, and
    every renewal and request that came meanwhile waited (bench/fleet.py's steady p99; 56-310
    ms with them frozen, still every 15-30 s). Their memory is still freed when nothing refers
    to them. And the collections that remain come seldom: the youngest generation is collected
    after GC_YOUNG_OBJECTS more objects are made than freed (Python's default: 700), the whole
    heap only after 50 of those; objects a request makes and frees never count."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_OBJECTS, 50, 100)

"""The agent: the heartbeat loop that makes what runs here what the control plane wants."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import sys
import threading
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import requests

from llmgw import engine
from llmgw.engines import DEFAULT_ENGINE, engine_names, get_engine

from .cache import BlobCache
from .config import REMOVED_EXIT_STATUS, NodeConfig
from .gpus import GpuDetector, capacity
from .replica import KEY_FILE, Replica, now_iso
from .spec import AnswerError, ReplicaSpec, parse_answer

log = logging.getLogger("llmgw.node")

HEARTBEAT_TIMEOUT = (5, 10)  # (connect, read) seconds
# Beats that may find nothing listening at the control plane's address, before it was first
# reached, before that is said as a problem (about 15 to 30 s at the default interval): until
# then the agent says it is waiting, as for a control plane that is still starting.
STARTING_BEATS = 8
# While nothing on the node changes it renews (POST /api/v1/node/renew, a few dozen bytes) instead
# of sending its whole report; the whole report goes at least this often all the same (as a
# kubelet's status, every 5 minutes), give or take a quarter at random (full_report_seconds).
# The first of them comes anywhere from a quarter of a period to a period and a quarter after the
# agent starts (first_full_report_seconds): nodes started together (a fleet brought up at once,
# every agent restarted by a configuration push) would otherwise send it in the same minute,
# every period, and spread over a whole period they send it at the fleet's steady rate from the
# start (5,000 nodes: 17 a second). Its schedule keeps its own pace (next_full_report): a report
# sent because something changed does not move it, or a model placed on thousands of nodes at
# once (each reporting its new replicas in the same minute) would line their periodic reports up
# into a wave every period.
FULL_REPORT_SECONDS = 300.0


def full_report_seconds() -> float:
    """Seconds from one periodic whole report to the next."""
    return FULL_REPORT_SECONDS * random.uniform(0.75, 1.25)


def first_full_report_seconds() -> float:
    """Seconds from the agent's first whole report to its first periodic one."""
    return FULL_REPORT_SECONDS * random.uniform(0.25, 1.25)


def next_full_report(due: float | None, now: float) -> float:
    """When the periodic whole report is due next, one period after the one `due` (None: the
    first periodic one, after the first report, `now`), never in the past (a node away for a
    while reports once, not once for each period it missed)."""
    if due is None:
        return now + first_full_report_seconds()
    following = due + full_report_seconds()
    return following if following > now else now + full_report_seconds()


# A 503's Retry-After is followed down to this (pause_after_failure).
MIN_RETRY_SECONDS = 1.0


def retry_after(status: int, header: str | None) -> float | None:
    """The seconds a 503 answer asks the node to wait before its next beat (its Retry-After
    header, in seconds; the gateway's gate says it when thousands of nodes report at once), or
    None."""
    value = (header or "").strip()
    if status != 503 or not value.isdigit() or len(value) > 6:
        return None
    return float(value)


def pause_after_failure(interval: float, asked: float | None) -> float:
    """How long the next beat waits after one that got no answer or a server error: the
    interval and a random part of it more, so that a fleet whose control plane was away does not
    come back all in the same second; or, when the answer asked for less (Retry-After, at least
    MIN_RETRY_SECONDS), that and a random part of it more: a node the gate turned away comes back
    as soon as it was told to, not an interval later, which would make the tail of a placement."""
    base = interval if asked is None else max(MIN_RETRY_SECONDS, min(interval, asked))
    return base * (1 + random.random())


# GPU memory used by others moves by a few MiB all the time: the digest counts it in these steps.
DIGEST_MEMORY_STEP_MB = 256


def report_digest(body: dict[str, Any]) -> str:
    """What a renewal names: the sha256 of the report, less what moves on its own all the time
    (a GPU's utilisation, its memory used in steps of DIGEST_MEMORY_STEP_MB), which the next whole
    report carries."""
    steady = dict(body)
    steady["devices"] = [
        {
            **{k: v for k, v in device.items() if k != "utilization_pct"},
            "memory_used_mb": int(device.get("memory_used_mb") or 0) // DIGEST_MEMORY_STEP_MB,
        }
        for device in body.get("devices") or []
    ]
    steady.pop("report_digest", None)
    text = json.dumps(steady, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _agent_version() -> str:
    try:
        return version("llmgw")
    except Exception:
        return "0.1.0"


class Agent:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        # Every control plane it may heartbeat to, and the one in use (agent.server).
        self.servers = tuple(
            dict.fromkeys(url.rstrip("/") for url in (config.server, *config.more_servers))
        )
        self.server = self.servers[0]
        self.replicas_dir = config.cache / "replicas"
        self.cache = BlobCache(config.cache, credentials=self._credentials_for)
        self.lock = threading.Lock()
        self.replicas: dict[str, Replica] = {}
        self.stopping: dict[str, Replica] = {}
        self.wake = threading.Event()
        self.shutdown = threading.Event()
        self.exiting = threading.Event()
        self.interval = config.heartbeat_interval
        self.started_at = now_iso()
        self.kept: tuple[tuple[str, str | None], ...] = ()
        self._over_budget: str | None = None
        self.node_name: str | None = None
        self._last_problem: str | None = None
        self._connected = False
        # Beats that found nothing listening before the control plane was first reached.
        self._unheard = 0
        self._warnings: tuple[str, ...] = ()
        self.exit_signal: str | None = None
        # What the control plane said when it answered that this node was removed (410): the
        # loop then ends, and the agent stops its engines and exits with REMOVED_EXIT_STATUS.
        self.removed: str | None = None
        self._lock_file: TextIO | None = None
        declared = None
        if config.gpus is not None:
            declared = (config.gpus, config.gpu_memory_gb or 0.0)
        self.gpus = GpuDetector(declared=declared)
        self._engine_backends: list[str] | None = None
        self._engines: list[str] | None = None
        self._gpu_engines: list[str] | None = None
        # The renewal's state: the generation of the last answer acted on, the digest of the last
        # whole report the control plane took, and when (monotonic). renewing turns off for good
        # when the control plane has no renewal (an older one answers 404).
        self.generation: int | None = None
        self.acked_digest: str | None = None
        self.full_due: float | None = None  # monotonic; None until the first report is taken
        self.renewing = True
        # The last beat got no answer, or a server error: the next waits a random part of an
        # interval more, so that a fleet whose control plane was overloaded or away does not
        # come back all in the same second (pause_after_failure); sooner when its answer asked
        # for less (retry_after).
        self.failing = False
        self.retry_after: float | None = None
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {config.token}"
        self.session.headers["User-Agent"] = f"llmgw-node/{_agent_version()}"

    def _credentials_for(self, url: str) -> dict[str, str]:
        """Downloads from a control plane's own origin (its mirror) carry the node token;
        other hosts never see it."""
        source = urlsplit(url)
        for server in map(urlsplit, self.servers):
            if (source.scheme, source.netloc) == (server.scheme, server.netloc):
                return {"Authorization": f"Bearer {self.config.token}"}
        return {}

    # -- start ----------------------------------------------------------------------------------

    def lock_cache(self) -> None:
        self.config.cache.mkdir(parents=True, exist_ok=True)
        path = self.config.cache / "agent.lock"
        lock_file = open(path, "a+")  # noqa: SIM115 - held open for the agent's lifetime
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.seek(0)
            holder = lock_file.read().strip() or "?"
            lock_file.close()
            raise SystemExit(
                f"llmgw node: another agent (pid {holder}) already uses the cache {self.config.cache}; "
                "each agent needs its own --cache."
            ) from None
        lock_file.seek(0)
        lock_file.truncate()
        lock_file.write(f"{os.getpid()}\n")
        lock_file.flush()
        self._lock_file = lock_file

    def adopt_leftovers(self) -> None:
        """Take over the engines an earlier agent left running; clean up after dead ones."""
        self.replicas_dir.mkdir(parents=True, exist_ok=True)
        for folder in sorted(self.replicas_dir.iterdir()):
            if folder.is_dir():
                self._adopt_one(folder)

    def _adopt_one(self, folder: Path) -> None:
        try:
            record = json.loads((folder / "state.json").read_text())
            spec = ReplicaSpec.from_json(record["spec"])
        except (OSError, ValueError, KeyError, TypeError, AnswerError):
            log.info("removing %s: it holds no engine (its replica never started one)", folder)
            shutil.rmtree(folder, ignore_errors=True)
            return
        replica = Replica(self, spec)
        replica.sha256 = record.get("sha256")
        replica.port = record.get("port")
        # The key the engine was started with, if any (the spec on disk never holds it).
        with contextlib.suppress(OSError):
            replica.key = (folder / KEY_FILE).read_text().strip() or None
        if record.get("state") == "failed":
            # A failed replica stays failed while it is wanted, across agent restarts too.
            replica.state = "failed"
            replica.message = record.get("message") or "failed"
            self.replicas[spec.id] = replica
            return
        pid, command = record.get("pid"), record.get("command")
        if (
            isinstance(pid, int)
            and isinstance(command, list)
            and _same_engine(engine.process_cmdline(pid), command)
            and isinstance(replica.port, int)
        ):
            replica.host = record.get("host") or replica.host
            replica.pid = pid
            replica.command = command
            replica.started_at = record.get("started_at")
            replica.state = "starting"
            replica.message = (
                f"adopted the engine (pid {pid}) an earlier agent left running on port "
                f"{replica.port}; checking that it answers"
            )
            log.info("%s: %s", replica.label, replica.message)
            if replica.ready_at_adoption():
                log.info("%s: ready: %s", replica.label, replica.message)
            self.replicas[spec.id] = replica
            replica.start(replica.run_adopted)
            return
        log.info("replica %s: its engine (pid %s) is gone; removing its folder", spec.id, pid)
        shutil.rmtree(folder, ignore_errors=True)

    # -- ports ----------------------------------------------------------------------------------

    def allocate_port(self, replica: Replica) -> int | None:
        """The first port in the range that no other replica of this agent holds and that is
        free to bind now; it is the replica's from then on."""
        low, high = self.config.port_range
        with self.lock:
            held = {
                other.port
                for other in [*self.replicas.values(), *self.stopping.values()]
                if other is not replica and other.port is not None
            }
            for port in range(low, high + 1):
                if port not in held and engine.port_is_free(self.config.address, port):
                    with replica.lock:
                        replica.port = port
                    return port
        return None

    # -- the heartbeat --------------------------------------------------------------------------

    @property
    def engine_backends(self) -> list[str]:
        """The backends of the engine binary (``llama-server --list-devices``), asked once: a
        binary is not rebuilt under a running agent (a rebuilt one needs a restarted agent)."""
        if self._engine_backends is None:
            backend = get_engine()
            executable = self.config.engine or backend.find()
            backends, problem = backend.backends(executable)
            if problem is not None and executable is not None:
                log.warning(
                    "cannot tell which backends the engine has (%s); reporting CPU only", problem
                )
            self._engine_backends = backends
        return self._engine_backends

    def executable_of(self, name: str) -> str | None:
        """Where engine ``name``'s program is on this node (None: not installed): for the
        default engine, --llama-server's path when given."""
        explicit = self.config.engine if name == DEFAULT_ENGINE else None
        return get_engine(name).find(explicit)

    @property
    def gpu_engines(self) -> list[str]:
        """The engines installed here that can put a model on GPUs (a GPU backend), asked once
        as engines is."""
        if self._gpu_engines is None:
            found = []
            for name in self.engines:
                if name == DEFAULT_ENGINE:
                    backends = self.engine_backends
                else:
                    backends, _ = get_engine(name).backends(self.executable_of(name))
                if any(b != "CPU" for b in backends):
                    found.append(name)
            self._gpu_engines = found
        return self._gpu_engines

    @property
    def engines(self) -> list[str]:
        """The engines installed here, found once: the control plane places a model only on a
        node that has its engine (an engine installed later needs a restarted agent)."""
        if self._engines is None:
            self._engines = [name for name in engine_names() if self.executable_of(name)]
        return self._engines

    def heartbeat_body(self) -> dict[str, Any]:
        with self.lock:
            replicas = list(self.replicas.values())
        devices, source = self.gpus.devices()
        gpus, gpu_memory_gb = capacity(devices)
        return {
            "capacity": {
                "memory_gb": self.config.memory_gb,
                "cores": self.config.cores,
                "gpus": gpus,
                "gpu_memory_gb": gpu_memory_gb,
            },
            "devices": devices,
            "devices_source": source,
            "engine_backends": self.engine_backends,
            "engines": self.engines,
            "gpu_engines": self.gpu_engines,
            "address": self.config.address,
            # The control plane routes only to replicas on these ports (fleet.trust).
            "port_range": {
                "first": self.config.port_range[0],
                "last": self.config.port_range[1],
            },
            "agent": {
                "version": _agent_version(),
                "pid": os.getpid(),
                "started_at": self.started_at,
            },
            "replicas": [replica.report() for replica in replicas],
        }

    def send_heartbeat(
        self, body: dict[str, Any], path: str = "heartbeat"
    ) -> requests.Response | None:
        """POST the heartbeat (or the renewal, `path` "renew") to the control plane in use; when
        nothing answers there (or it answers with a server error, as a gateway whose web process
        died does), to the next of the others in turn. The first that answers is used from then
        on: all of them share one database, so any may take the heartbeat. None when none
        answered (said once)."""
        failures: list[tuple[str, str, str]] = []  # (server, kind, detail)
        server_error: tuple[str, requests.Response] | None = None
        start = self.servers.index(self.server)
        for server in self.servers[start:] + self.servers[:start]:
            try:
                response = self.session.post(
                    f"{server}/api/v1/node/{path}", json=body, timeout=HEARTBEAT_TIMEOUT
                )
            except requests.ConnectionError:
                failures.append((server, "unreachable", "nothing answered"))
                continue
            except requests.Timeout:
                failures.append((server, "timeout", "it did not answer in time"))
                continue
            except requests.RequestException as exc:
                failures.append((server, "failed", str(exc)))
                continue
            if response.status_code >= 500 and len(self.servers) > 1:
                failures.append((server, "error", f"HTTP {response.status_code}"))
                server_error = server_error or (server, response)
                continue
            self._use(server, failures)
            self.failing = response.status_code >= 500
            self.retry_after = retry_after(
                response.status_code, response.headers.get("Retry-After")
            )
            return response
        self.failing = True
        self.retry_after = None
        if server_error is not None:  # an answer, if not a good one: said as a refusal
            self._use(server_error[0], failures)
            answer = server_error[1]
            self.retry_after = retry_after(answer.status_code, answer.headers.get("Retry-After"))
            return answer
        self._unreachable(failures)
        return None

    def _use(self, server: str, failures: list[tuple[str, str, str]]) -> None:
        if server != self.server:
            why = "; ".join(f"{url}: {detail}" for url, _, detail in failures)
            log.warning("heartbeating to the control plane at %s from now on (%s)", server, why)
            self.server = server

    def _unreachable(self, failures: list[tuple[str, str, str]]) -> None:
        if len(failures) > 1:
            why = "; ".join(f"{url}: {detail}" for url, _, detail in failures)
            self._problem(
                f"cannot reach any of the control planes ({why}). "
                "Keeping the engines running and trying again."
            )
            return
        server, kind, detail = failures[0]
        if kind == "unreachable" and not self._connected and self._unheard < STARTING_BEATS:
            # Not reached once since this agent started: a control plane started with it (the
            # run command's, a reboot's) is seconds from listening. Said as that, once; a
            # problem only if it stays so.
            self._unheard += 1
            if self._unheard == 1:
                log.info(
                    "waiting for the control plane at %s to answer (nothing listens there yet; "
                    "it may still be starting)",
                    server,
                )
            return
        if kind == "unreachable":
            self._problem(
                f"cannot reach the control plane at {server}: nothing answered. "
                "Keeping the engines running and trying again."
            )
        elif kind == "timeout":
            self._problem(
                f"the control plane at {server} did not answer in time. "
                "Keeping the engines running and trying again."
            )
        else:
            self._problem(f"the heartbeat to {server} failed: {detail}. Trying again.")

    def heartbeat(self) -> None:
        """One beat: a renewal while the report is the one the control plane last took (and
        took lately), else the whole report. A renewal the control plane does not take (it
        wants the report) is followed by the report at once."""
        body = self.heartbeat_body()
        digest = report_digest(body)
        now = time.monotonic()
        due = self.full_due is None or now >= self.full_due
        if self.renewing and digest == self.acked_digest and not due and self.renew(digest):
            return
        body["report_digest"] = digest
        if self.full_heartbeat(body):
            self.acked_digest = digest
            if due:  # the periodic one (or the first): the next is a period on
                self.full_due = next_full_report(self.full_due, now)

    def renew(self, digest: str) -> bool:
        """POST a renewal; False when the whole report should go now instead."""
        response = self.send_heartbeat(
            {"generation": self.generation, "report_digest": digest}, path="renew"
        )
        if response is None:
            return True  # nothing answered: the report would not have been heard either
        if self._removed(response):
            return True
        if response.status_code == 404:
            # A control plane without renewals (an older one; the renewal itself never answers
            # 404): whole reports from now on.
            log.info(
                "the control plane at %s takes no renewals; sending whole reports", self.server
            )
            self.renewing = False
            return False
        if response.status_code != 200:
            return False  # the heartbeat says what is wrong, as it always has
        try:
            answer = response.json()
            if not isinstance(answer, dict):
                raise ValueError("not an object")
            if answer.get("report") != "current":
                self.acked_digest = None
                return False
            if not answer.get("changed"):
                self._recovered(response)
                self._set_interval(answer.get("heartbeat_interval"))
                return True
        except ValueError:
            return False
        return self._act_on(response)

    def full_heartbeat(self, body: dict[str, Any]) -> bool:
        """Send the whole report and act on the answer; whether the control plane took it."""
        response = self.send_heartbeat(body)
        if response is None or self._removed(response):
            return False
        if response.status_code == 401:
            self._problem(
                f"the control plane at {self.server} does not know this node's token; was the "
                "node removed? Register it again and restart the agent with the new token. "
                "Keeping the engines running and trying again."
            )
            return False
        if response.status_code != 200:
            self._problem(
                f"the control plane at {self.server} refused the heartbeat "
                f"(HTTP {response.status_code}): {_detail(response)}. Trying again."
            )
            return False
        return self._act_on(response)

    def _removed(self, response: requests.Response) -> bool:
        """Whether the control plane says this node was removed (410, code node_removed; a
        token it never knew, or no longer remembers, is 401 instead): if so the loop ends."""
        if response.status_code != 410:
            return False
        try:
            answer = response.json()
        except ValueError:
            return False
        if not isinstance(answer, dict) or answer.get("code") != "node_removed":
            return False
        said = str(answer.get("detail") or "this node was removed")[:1000]
        self.removed = f"the control plane at {self.server} says: {said}"
        self.shutdown.set()
        self.wake.set()
        return True

    def _act_on(self, response: requests.Response) -> bool:
        """Make what runs here what a 200 answer asks for; whether it was understood."""
        try:
            answer = parse_answer(response.json())
        except (ValueError, AnswerError) as exc:
            self._problem(
                f"the control plane at {self.server} answered something this agent does not "
                f"understand ({exc}); nothing changes until it answers properly."
            )
            self.generation = None
            return False
        self._recovered(response)
        self._warn(response)
        self._set_interval(answer.interval)
        self.kept = answer.keep
        self.reconcile(answer.replicas)
        self.generation = answer.generation
        self.evict()
        return True

    def _set_interval(self, interval: Any) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int | float) or interval <= 0:
            return
        if interval != self.interval:
            log.info("heartbeating every %g s, as the control plane asks", interval)
            self.interval = float(interval)

    def _problem(self, text: str) -> None:
        # Said once, not every two seconds; said again when it changes.
        if text != self._last_problem:
            log.warning("%s", text)
            self._last_problem = text

    def _warn(self, response: requests.Response) -> None:
        """What the control plane does not believe of this node's report (capacity above what
        it registered with): said once, and again when it changes."""
        with contextlib.suppress(ValueError, AttributeError):
            warnings = response.json().get("warnings") or []
            if not isinstance(warnings, list):
                return
            current = tuple(str(w)[:1000] for w in warnings[:10])
            if current != self._warnings:
                for warning in current:
                    log.warning("the control plane says: %s", warning)
                self._warnings = current

    def _recovered(self, response: requests.Response) -> None:
        with contextlib.suppress(ValueError, AttributeError):
            self.node_name = response.json().get("node") or self.node_name
        if self._last_problem is not None or not self._connected:
            log.info(
                "connected to the control plane at %s as node %s",
                self.server,
                self.node_name or "?",
            )
        self._connected = True
        self._last_problem = None

    def reconcile(self, specs: list[ReplicaSpec]) -> None:
        """Start what is wanted and missing; stop what runs and is not wanted."""
        wanted = {spec.id: spec for spec in specs}
        with self.lock:
            unwanted = [r for rid, r in self.replicas.items() if rid not in wanted]
            for replica in unwanted:
                del self.replicas[replica.spec.id]
                self.stopping[replica.spec.id] = replica
            for spec in specs:
                # An id that is still being stopped is started afresh once it is gone.
                if spec.id in self.replicas or spec.id in self.stopping:
                    continue
                replica = Replica(self, spec)
                self.replicas[spec.id] = replica
                log.info("%s: wanted; fetching %s", replica.label, spec.source)
                replica.start(replica.run_new)
        for replica in unwanted:
            threading.Thread(
                target=self._stop_replica,
                args=(replica,),
                name=f"stop-{replica.spec.id}",
                daemon=True,
            ).start()

    def needed_blobs(self) -> set[str]:
        """The sha256 of every file a replica here uses or may use (running, starting,
        stopping), and of the previous revisions the control plane asks to keep."""
        with self.lock:
            replicas = [*self.replicas.values(), *self.stopping.values()]
        sources = list(self.kept)
        for replica in replicas:
            sources.append((replica.spec.source, replica.spec.sha256 or replica.sha256))
            for adapter in replica.spec.adapters:
                sources.append((adapter.source, adapter.sha256))
                sources += [(url, None) for url in replica.beside_adapter(adapter)]
            if replica.spec.mmproj is not None:
                sources.append((replica.spec.mmproj.source, replica.spec.mmproj.sha256))
            sources += [(f.source, f.sha256) for f in replica.spec.files]
        return {sha for source, known in sources if (sha := self.cache.sha256_of(source, known))}

    def evict(self) -> None:
        """Keep the blob cache within --cache-max-gb: least recently used first, never a
        file a replica here needs or a previous revision the control plane asks to keep."""
        if self.config.cache_max_gb is None:
            return
        limit = int(self.config.cache_max_gb * 1e9)
        evicted, total = self.cache.evict(limit, self.needed_blobs())
        for sha in evicted:
            log.info("cache: evicted %s, the least recently used file no replica needs", sha)
        problem = None
        if total > limit:
            problem = (
                f"cache: the files replicas here need take {total / 1e9:.2f} GB, above "
                f"--cache-max-gb {self.config.cache_max_gb:g}; nothing more can be evicted"
            )
        if problem is not None and problem != self._over_budget:
            log.warning("%s", problem)
        self._over_budget = problem

    def _stop_replica(self, replica: Replica) -> None:
        try:
            replica.stop()
        finally:
            with self.lock:
                self.stopping.pop(replica.spec.id, None)

    # -- the loop -------------------------------------------------------------------------------

    def check_address(self) -> None:
        try:
            engine.port_is_free(self.config.address, 0)
        except OSError as exc:
            raise SystemExit(
                f"llmgw node: engines cannot listen on {self.config.address}: "
                f"{exc.strerror or exc}. --address must be an address of this machine that the "
                "gateway can reach."
            ) from None

    def run(self) -> int:
        self.check_address()
        self.lock_cache()
        self.cache.prepare()
        executable = self.config.engine or get_engine().find()
        if executable is None:
            log.warning(
                "llama-server is not installed beside %s nor on PATH, so every engine will fail "
                "to start; `make setup` builds it, or give its path with --llama-server",
                sys.executable,
            )
        else:
            log.info("engines run %s (backends: %s)", executable, ", ".join(self.engine_backends))
        for name in self.engines:
            if name != DEFAULT_ENGINE:
                log.info("engine %s: %s", name, self.executable_of(name))
        devices, source = self.gpus.devices()
        if devices:
            log.info(
                "GPUs (%s): %s",
                source,
                "; ".join(
                    f"{d['index']}: {d['name']}, {d['memory_total_mb']} MiB" for d in devices
                ),
            )
        others = f" (then {', '.join(self.servers[1:])} when it does not answer)"
        log.info(
            "node agent %s (pid %s) heartbeating to %s%s; cache %s; engines on %s, ports %s-%s",
            _agent_version(),
            os.getpid(),
            self.server,
            others if len(self.servers) > 1 else "",
            self.config.cache,
            self.config.address,
            *self.config.port_range,
        )
        self.adopt_leftovers()
        while not self.shutdown.is_set():
            self.wake.clear()
            try:
                self.heartbeat()
            except Exception:
                # A bug in handling one answer must not take the engines' supervisor down.
                log.exception("the heartbeat failed unexpectedly; trying again")
            self.wake.wait(self.next_pause())
            # State changes wake the loop early; a short pause keeps a burst to one heartbeat.
            self.shutdown.wait(0.05)
        if self.removed is not None:
            return self.exit_removed(self.removed)
        log.info("received %s; exiting", self.exit_signal or "a stop request")
        self.exit()
        return 0

    def exit_removed(self, said: str) -> int:
        """This node was removed: its engines serve nobody now (the gateway routes only to the
        replicas of known nodes) and no agent will be told to run them, so they are stopped,
        unless --keep-engines-when-removed; then the agent exits for good (REMOVED_EXIT_STATUS,
        which its systemd unit does not restart)."""
        log.warning("%s", said)
        replicas = self._settled()
        running = sum(1 for replica in replicas if replica.pid is not None)
        if self.config.keep_engines_when_removed:
            log.warning(
                "leaving this node's %d engine(s) running, as --keep-engines-when-removed asks; "
                "the gateway no longer sends them requests, and an agent started later with this "
                "cache (%s) adopts them and stops them unless its control plane wants them. "
                "Exiting with status %d.",
                running,
                self.config.cache,
                REMOVED_EXIT_STATUS,
            )
            return REMOVED_EXIT_STATUS
        log.warning(
            "stopping this node's %d engine(s) (--keep-engines-when-removed leaves them running)",
            running,
        )
        self._stop_all(replicas)
        log.warning("stopped this node's engines; exiting with status %d", REMOVED_EXIT_STATUS)
        return REMOVED_EXIT_STATUS

    def next_pause(self) -> float:
        """Seconds until the next beat, unless a change wakes the loop first."""
        if self.failing:
            return pause_after_failure(self.interval, self.retry_after)
        return self.interval

    def request_shutdown(self, signum: int, _frame: Any) -> None:
        # Only set flags here: the loop logs and exits (logging from a handler can interleave).
        self.exit_signal = signal.Signals(signum).name
        self.shutdown.set()
        self.wake.set()

    def exit(self) -> None:
        replicas = self._settled()
        if not self.config.stop_engines_on_exit:
            running = [r for r in replicas if r.pid is not None]
            if running:
                log.info(
                    "leaving %d engine(s) running for the next agent to adopt "
                    "(--stop-engines-on-exit stops them instead)",
                    len(running),
                )
            return
        self._stop_all(replicas)

    def _settled(self) -> list[Replica]:
        """Every replica, once no engine start is in progress or can begin."""
        with self.lock:
            replicas = [*self.replicas.values(), *self.stopping.values()]
        # Taking each replica's lock waits out an engine start in progress, after which no
        # worker starts another: whatever runs is recorded in a state.json, for adoption.
        self.exiting.set()
        for replica in replicas:
            with replica.lock:
                pass
        return replicas

    @staticmethod
    def _stop_all(replicas: list[Replica]) -> None:
        stoppers = [threading.Thread(target=replica.stop) for replica in replicas]
        for stopper in stoppers:
            stopper.start()
        for stopper in stoppers:
            stopper.join()


def _same_engine(running: list[str] | None, recorded: list[str]) -> bool:
    """Whether a live process is the engine that was recorded: the same arguments, which name
    the replica's blob, port or config file. The interpreter's path is not compared, so that a
    reinstalled virtualenv does not turn running engines into orphans; a reused pid never
    matches."""
    return running is not None and len(running) > 1 and running[1:] == recorded[1:]


def _detail(response: requests.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("detail"):
        return str(body["detail"])
    text = response.text.strip().replace("\n", " ")
    return text[:200] if text else response.reason or "no detail"

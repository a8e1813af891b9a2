"""Real processes (gunicorn, celery worker and beat, the run command): a bad server.yaml stops
each with the clear message and a non-zero exit, and a 500 is logged with its traceback."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.support.system import ROOT, free_port, wait_for
from tests.support.waiting import stays

BIN = Path(sys.executable).parent
BAD_CONFIG = "cluster:\n  reconcile_interval: often\n"
MESSAGE = (
    "cannot start: {path}: cluster.reconcile_interval: 'often' is not a duration: use a number "
    "with a unit (s, m, h, d), like 15m, 6h or 1h30m (line 2)"
)
# The quiet run command's node_lost_after (cluster.node_lost_after), and how long its terminal
# must stay quiet: past that, plus a reconcile pass (every 5 s) to notice a silent node, plus
# room for a loaded machine.
NODE_LOST_AFTER = 10
QUIET_SECONDS = NODE_LOST_AFTER + 5 + 3


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A migrated SQLite database and a var folder of its own; server.yaml in tmp_path."""
    environment = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("DJANGO", "LLMGW", "PYTEST"))},
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "LLMGW_VAR_DIR": str(tmp_path / "var"),
        "LLMGW_CONFIG": str(tmp_path / "server.yaml"),
        "LLMGW_SECRET_KEY": "test-secret-key-for-process-tests",
    }
    migrate = [sys.executable, "manage.py", "migrate", "-v0"]
    subprocess.run(migrate, env=environment, cwd=ROOT, check=True, timeout=120)
    return environment


def run(argv: list[str], env: dict[str, str], timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def bad_config(tmp_path: Path) -> Path:
    path = tmp_path / "server.yaml"
    path.write_text(BAD_CONFIG)
    return path


@pytest.mark.parametrize("workers", [1, 2])
def test_gunicorn_stops_on_a_bad_config_instead_of_restarting_workers(
    env: dict[str, str], bad_config: Path, workers: int
) -> None:
    gunicorn = [str(BIN / "gunicorn"), "llmgw_site.wsgi", "--bind", f"127.0.0.1:{free_port()}"]
    result = run([*gunicorn, "--workers", str(workers)], env)  # returns: it did not loop
    assert "llmgw web: " + MESSAGE.format(path=bad_config) in result.stderr
    if workers == 1:
        assert result.returncode == 4  # gunicorn: the application failed to load
        assert "Traceback" not in result.stderr
    else:
        # With two workers failing at once gunicorn may report the second halt as its own
        # error (exit 1); either way it stops.
        assert result.returncode in (1, 4)


@pytest.mark.parametrize("process", ["worker", "beat"])
def test_celery_stops_on_a_bad_config(
    env: dict[str, str], bad_config: Path, tmp_path: Path, process: str
) -> None:
    argv = [str(BIN / "celery"), "-A", "llmgw_site", process]
    argv += ["--pool", "solo"] if process == "worker" else ["-s", str(tmp_path / "beat")]
    result = run(argv, env)
    assert result.returncode == 2
    assert f"llmgw {process}: " + MESSAGE.format(path=bad_config) in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("demo", [True, False])
def test_the_run_command_stops_on_a_bad_config_with_the_message(
    env: dict[str, str], bad_config: Path, demo: bool
) -> None:
    argv = [sys.executable, "manage.py", "llmgw_run", "--no-node"]
    result = run(argv if demo else [*argv, "--no-demo"], env)
    assert result.returncode == 2
    assert result.stderr.strip() == "llmgw run: " + MESSAGE.format(path=bad_config)
    assert "started web" not in result.stdout


def test_the_run_command_stops_when_one_of_its_processes_will_not_stay_up(
    env: dict[str, str],
) -> None:
    """The public port is taken: the gateway exits each time it is started, and its third exit
    within a minute stops everything with a failure."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**env, "LLMGW_PUBLIC_URL": f"http://127.0.0.1:{port}"}
        argv = [sys.executable, "manage.py", "llmgw_run", "--no-node", "--no-demo"]
        result = run(argv, env, timeout=120)
    # The public port is the gateway's; the web listens behind it.
    assert result.returncode != 0
    assert re.search(
        r"^gateway exited with code \d+; starting it again in 1 s\.$", result.stderr, re.M
    )
    assert re.search(
        r"^gateway exited with code \d+; starting it again in 2 s\.$", result.stderr, re.M
    )
    assert re.search(
        r"^gateway exited with code \d+, 3 times in 60 s; stopping the rest\.$", result.stderr, re.M
    )


def in_background(argv: list[str], env: dict[str, str], out: Path) -> subprocess.Popen[bytes]:
    """The command running in its own session, its output (both streams) in `out`."""
    with out.open("wb") as sink:
        return subprocess.Popen(
            argv, env=env, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip


def test_the_run_command_starts_again_a_process_that_dies(env: dict[str, str]) -> None:
    """Beat SIGKILLed (as the kernel's OOM killer would): the run command starts it again, and
    a Ctrl-C afterwards still stops every process it started, the new beat included."""
    env = {**env, "LLMGW_PUBLIC_URL": f"http://127.0.0.1:{free_port()}"}
    argv = [sys.executable, "manage.py", "llmgw_run", "--no-node", "--no-demo"]
    out = Path(env["LLMGW_VAR_DIR"]).parent / "run.out"
    beat_log = Path(env["LLMGW_VAR_DIR"]) / "log" / "beat.log"  # celery's INFO lines go there

    def beat_said() -> str:
        return beat_log.read_text() if beat_log.exists() else ""

    run_command = in_background(argv, env, out)
    try:

        def started(name: str) -> list[int]:
            return [
                int(p)
                for p in re.findall(rf"^started {name} \(pid (\d+)\)$", out.read_text(), re.M)
            ]

        wait_for(
            lambda: started("beat") and started("gateway"), timeout=120, what="the run command"
        )
        first = started("beat")[0]
        wait_for(lambda: "beat: Starting" in beat_said(), timeout=60, what="beat up")
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: len(started("beat")) == 2, timeout=30, what="beat started again")
        assert re.search(
            r"^beat exited with code -9; starting it again in 1 s\.$", out.read_text(), re.M
        )
        second = started("beat")[1]
        assert second != first and _alive(second)
        wait_for(
            lambda: beat_said().count("beat: Starting") == 2, timeout=60, what="the new beat up"
        )
        children = [pid for name in ("gateway", "web", "worker") for pid in started(name)]
        assert all(_alive(pid) for pid in children)  # nothing else was started again or stopped
    finally:
        run_command.send_signal(signal.SIGINT)
        run_command.wait(timeout=90)
    assert not any(_alive(pid) for pid in [*started("beat"), *children])
    assert "stopping the rest" not in out.read_text()


def test_stopping_a_child_takes_its_whole_process_group() -> None:
    """A child that ignores SIGTERM is killed after its grace, and so is what it started
    (as a celery worker's pool processes would be), not left holding the terminal."""
    from llmgw_site.management.commands.llmgw_run import stop_child

    script = 'trap "" TERM; sleep 300 & echo $!; wait'
    child = subprocess.Popen(
        ["sh", "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert child.stdout is not None
    grandchild = int(child.stdout.readline())
    stop_child(child, grace=1)  # type: ignore[arg-type]
    assert child.returncode == -signal.SIGKILL
    wait_for(lambda: not _alive(grandchild), timeout=10, what="the grandchild gone")


def test_the_run_command_stops_the_node_then_beat_then_the_rest_at_once(tmp_path: Path) -> None:
    """The node first (its engines stop while the web answers), then beat (it hands its lease on
    at once: a worker slow to stop must not hold the schedule back until the lease runs out),
    then the rest together: two that ignore SIGTERM cost one grace period, not two."""
    from llmgw_site.management.commands.llmgw_run import Child, Supervisor

    marks = tmp_path / "marks"

    def child(name: str, on_term: str) -> Child:
        script = f'trap "echo {name} >> {marks}; {on_term}" TERM; while :; do sleep 0.05; done'
        return Child(name, ["sh", "-c", script])

    supervisor = Supervisor(None, None)
    for one in (
        child("gateway", "exit 0"),
        child("web", ""),  # ignores SIGTERM
        child("worker", ""),  # ignores SIGTERM
        child("beat", "sleep 0.3; exit 0"),
        child("node", "sleep 0.3; exit 0"),
    ):
        one.start()
        supervisor.adopt(one)
    pids = [one.process.pid for one in supervisor.children.values() if one.process]
    wait_for(
        lambda: all(_catches(pid, signal.SIGTERM) for pid in pids),
        timeout=10,
        what="every child's shell to have set its SIGTERM trap",
    )
    started = time.monotonic()
    supervisor.stop_all()
    took = time.monotonic() - started
    order = marks.read_text().split()
    assert order[:2] == ["node", "beat"], order
    assert sorted(order[2:]) == ["gateway", "web", "worker"], order
    assert 20 <= took < 30, took  # one grace (20 s) for both that ignored SIGTERM
    for one in supervisor.children.values():
        assert one.process is not None and one.process.returncode is not None


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for the signal (a shell's trap is set)."""
    status = Path(f"/proc/{pid}/status").read_text()
    [caught] = [line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")]
    return bool(int(caught, 16) >> (signum - 1) & 1)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its (dead) parent's reaper."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_500_is_logged_with_its_traceback_on_one_line(
    env: dict[str, str], tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "web.log"
    argv = [str(BIN / "gunicorn"), "llmgw_site.wsgi", "--bind", f"127.0.0.1:{port}"]
    environment = {**env, "DJANGO_SETTINGS_MODULE": "tests.support.failing_site"}
    with log.open("w") as out:
        web = subprocess.Popen(argv, env=environment, cwd=ROOT, stdout=out, stderr=out)
    try:
        # Once it listens, the one request, sent once: a retried one (its first try timed out
        # while the workers booted on a busy machine, then answered) would log a second 500.
        wait_for(lambda: _listening(port), what="the web process to listen")
        response = requests.get(
            f"http://127.0.0.1:{port}/boom?x=1", headers={"X-Request-ID": "boom-1"}, timeout=120
        )
        assert response.status_code == 500
    finally:
        web.send_signal(signal.SIGTERM)
        web.wait(timeout=30)
    [line] = [line for line in log.read_text().splitlines() if "django.request" in line]
    assert " ERROR django.request: Internal Server Error: /boom status=500 " in line
    assert response.headers["X-Request-ID"] == "boom-1"
    assert (
        'method=GET path="/boom?x=1" request_id=boom-1 '
        'traceback="Traceback (most recent call last):\\n' in line
    )
    assert 'ZeroDivisionError: the view divided by zero on purpose"' in line


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_a_failed_task_is_logged_with_its_traceback_on_one_line(
    env: dict[str, str], tmp_path: Path
) -> None:
    env = {**env, "LLMGW_CELERY_QUEUE": f"failing-{tmp_path.name}"}
    queue = (
        "import django, os; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'llmgw_site.settings'); "
        "django.setup(); from llmgw_site.celery import app; "
        "app.send_task('registry.tasks.run_fetch', args=['not-a-number'])"
    )
    subprocess.run([sys.executable, "-c", queue], env=env, cwd=ROOT, check=True, timeout=60)
    log = tmp_path / "worker.log"
    argv = [str(BIN / "celery"), "-A", "llmgw_site", "worker", "--pool", "solo"]
    with log.open("w") as out:
        worker = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=out)
    try:
        wait_for(lambda: "celery.app.trace" in log.read_text(), what="the task's failure")
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
    [line] = [line for line in log.read_text().splitlines() if "celery.app.trace" in line]
    assert " ERROR celery.app.trace: Task registry.tasks.run_fetch[" in line
    assert 'traceback="Traceback (most recent call last):\\n' in line
    assert "expected a number but got 'not-a-number'" in line


def test_the_run_commands_terminal_stays_quiet_while_the_logs_under_var_get_the_chatter(
    env: dict[str, str],
) -> None:
    """Idle with a node heartbeating and beat sending its tasks, the terminal gets no line: the
    web's access log and Celery's lines about each task go to var/log/, which the start-up
    says. A request's X-Request-ID comes back from the web through the gateway and is in the
    access log's line about it; the gateway's refusal names it too."""
    from llmgw_site.management.commands.llmgw_run import GATEWAY_WORKERS

    # Quiet past node_lost_after: a node that only renews is not taken for silent (the
    # reconciler would say so on the terminal). 10 s rather than the default 30 s: the same
    # test, a shorter wait.
    Path(env["LLMGW_CONFIG"]).write_text(f"cluster:\n  node_lost_after: {NODE_LOST_AFTER}s\n")
    public = f"http://127.0.0.1:{free_port()}"
    env = {**env, "LLMGW_PUBLIC_URL": public}
    argv = [sys.executable, "manage.py", "llmgw_run", "--no-demo"]
    out = Path(env["LLMGW_VAR_DIR"]).parent / "run.out"
    logs = Path(env["LLMGW_VAR_DIR"]) / "log"

    def said(name: str) -> str:
        path = logs / name
        return path.read_text() if path.exists() else ""

    run_command = in_background(argv, env, out)
    try:
        wait_for(
            lambda: (
                "llmgw node: connected" in out.read_text()
                and "ready." in said("worker.log")
                and "Sending due task" in said("beat.log")
            ),
            timeout=75,
            what="the run command up",
        )
        assert f"  Logs:              {logs}: web-access.log" in out.read_text()

        # The request ID, through the gateway to the web and back.
        response = requests.get(
            f"{public}/api/v1/models", headers={"X-Request-ID": "run-cmd-1"}, timeout=10
        )
        assert response.status_code in (401, 403)
        assert response.raw.headers.getlist("X-Request-ID") == ["run-cmd-1"]
        replaced = requests.get(
            f"{public}/api/v1/models", headers={"X-Request-ID": "a b"}, timeout=10
        )
        assert re.fullmatch(r"[0-9a-f]{32}", replaced.headers["X-Request-ID"])
        refused = requests.get(
            f"{public}/v1/models", headers={"X-Request-ID": "run-cmd-2"}, timeout=10
        )
        assert refused.status_code == 401
        assert refused.headers["X-Request-ID"] == "run-cmd-2"
        assert refused.json()["error"]["request_id"] == "run-cmd-2"
        wait_for(lambda: "run-cmd-1" in said("web-access.log"), timeout=10, what="access log")
        [line] = [line for line in said("web-access.log").splitlines() if "run-cmd-1" in line]
        assert '"GET /api/v1/models HTTP/1.1" 40' in line and line.endswith(" run-cmd-1")

        wait_for(
            lambda: (
                out.read_text().count("Application startup complete.") == GATEWAY_WORKERS
                and "llmgw is running at" in out.read_text()
            ),
            timeout=30,
            what="the last of start-up on the terminal: each gateway worker's banner",
        )
        terminal = out.read_text().splitlines()
        before = {name: said(name).count("\n") for name in ("worker.log",)}
        # Time is what is tested: node_lost_after and a reconcile pass go by with no line on
        # the terminal (two at most: none, unless something went wrong meanwhile).
        try:
            stays(
                lambda: len(out.read_text().splitlines()) <= len(terminal) + 2,
                seconds=QUIET_SECONDS,
                interval=0.5,
                what="the terminal quiet",
            )
        except AssertionError as said_something:
            new = out.read_text().splitlines()[len(terminal) :]
            raise AssertionError(f"{said_something}: {new}") from None
        # Meanwhile the worker's log got beat's tasks. (The node's renewals, every 2 s, are
        # answered by the gateway, which writes no access line; its whole reports go to the web.)
        assert said("worker.log").count("\n") - before["worker.log"] >= 10
        assert "succeeded in" in said("worker.log")
        assert "POST /api/v1/node/heartbeat" in said("web-access.log")
    finally:
        run_command.send_signal(signal.SIGINT)
        run_command.wait(timeout=90)

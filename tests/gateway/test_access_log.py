"""The gateway's access log (gateway.accesslog): one whole line per /v1/ request, its lines'
shapes, its bound, its rotation shared by several processes, and a real gateway writing it."""

from __future__ import annotations

import json
import multiprocessing
import stat
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from core.env import EnvError
from gateway import accesslog
from gateway.accesslog import AccessLog, json_line, text_line
from gateway.metrics import metrics
from tests.gateway.conftest import Gateway, GatewayServer
from tests.gateway.fake_engine import FakeEngine
from tests.support.waiting import wait_for

# 2026-12-07T08:30:01.123Z
AT = 1_796_632_201.1234
ENTRY = (AT, "req-1", 12, "chat", "chat", 200, 31, 5, 0.0004, 0.01234)


def no_names(ids: Collection[int]) -> dict[int, str]:
    return {}


def record(access: AccessLog, request_id: str = "req-1", **fields: Any) -> None:
    values: dict[str, Any] = {
        "key_id": None,
        "model": "chat",
        "endpoint": "chat",
        "status": 200,
        "prompt": 3,
        "completion": 5,
        "queued": 0.0,
        "seconds": 0.01,
    }
    access.record(request_id=request_id, **{**values, **fields})


def lines_of(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


# -- the lines ------------------------------------------------------------------------------------


def test_it_writes_a_text_line_of_key_value_words() -> None:
    assert text_line(ENTRY, "app") == (
        "2026-12-07T08:30:01.123Z request_id=req-1 key_id=12 key=app model=chat endpoint=chat "
        "status=200 prompt_tokens=31 completion_tokens=5 queued_ms=0.4 ms=12.3\n"
    )


def test_it_quotes_a_key_name_that_is_not_one_word_so_it_cannot_break_the_line() -> None:
    line = text_line(ENTRY, 'alice\'s app\nstatus=500 "x"')
    assert line.count("\n") == 1 and line.endswith("\n")
    assert ' key="alice\'s app\\nstatus=500 \\"x\\"" model=chat ' in line
    # A key named "-" is not taken for none.
    assert ' key="-" ' in text_line(ENTRY, "-")


def test_it_writes_a_dash_for_what_a_request_did_not_have() -> None:
    refused = (AT, "req-2", None, None, "completions", 401, 0, 0, 0.0, 0.0005)
    assert text_line(refused, None) == (
        "2026-12-07T08:30:01.123Z request_id=req-2 key_id=- key=- model=- endpoint=completions "
        "status=401 prompt_tokens=0 completion_tokens=0 queued_ms=0.0 ms=0.5\n"
    )


def test_it_writes_the_same_fields_as_a_json_line() -> None:
    line = json_line(ENTRY, "alice's app")
    assert line.endswith("\n") and line.count("\n") == 1
    assert json.loads(line) == {
        "time": "2026-12-07T08:30:01.123Z",
        "request_id": "req-1",
        "key_id": 12,
        "key": "alice's app",
        "model": "chat",
        "endpoint": "chat",
        "status": 200,
        "prompt_tokens": 31,
        "completion_tokens": 5,
        "queued_ms": 0.4,
        "ms": 12.3,
    }


# -- the file ----------------------------------------------------------------------------------


def test_it_writes_what_was_recorded_when_closed_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "log" / "gateway-access.log"
    access = AccessLog(path, names=no_names)
    record(access, "first")
    record(access, "second", status=429)
    access.close()  # never started: close() writes what is left
    written = lines_of(path)
    assert [line.split()[1] for line in written] == ["request_id=first", "request_id=second"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert access.written == 2 and access.dropped == 0


def test_its_writer_thread_writes_within_a_moment(tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    access = AccessLog(path, form="json", names=no_names)
    access.start()
    try:
        record(access, "soon")
        wait_for(lambda: "soon" in path.read_text(), timeout=5, what="the line written")
        assert json.loads(lines_of(path)[0])["request_id"] == "soon"
    finally:
        access.close()


def test_a_full_buffer_drops_lines_and_counts_them(tmp_path: Path) -> None:
    board = metrics()
    access = AccessLog(tmp_path / "access.log", names=no_names, board=board, max_pending=3)
    for number in range(5):
        record(access, f"r{number}")
    assert access.dropped_full == 2
    assert board.access_log_dropped.labels("full")._value.get() == 2
    assert access.write_pending() == 3
    assert board.access_log_lines._value.get() == 3
    record(access, "r5")  # room again
    access.close()
    assert [line.split()[1] for line in lines_of(tmp_path / "access.log")] == [
        "request_id=r0",
        "request_id=r1",
        "request_id=r2",
        "request_id=r5",
    ]


def test_a_file_it_cannot_write_drops_the_batch_counts_it_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    board = metrics()
    path = tmp_path / "access.log"
    access = AccessLog(path, names=no_names, board=board)
    record(access, "lost")

    def full_disk(data: bytes, size: int) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(access.file, "_write", full_disk)
        assert access.write_pending() == 0
    assert board.access_log_dropped.labels("unwritable")._value.get() == 1
    record(access, "kept")
    access.close()
    assert [line.split()[1] for line in lines_of(path)] == ["request_id=kept"]


def test_it_rotates_at_its_size_keeping_its_backups(tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    line_bytes = len(text_line((AT, "r000", None, "chat", "chat", 200, 3, 5, 0.0, 0.01), None))
    access = AccessLog(path, names=no_names, max_bytes=3 * line_bytes, backups=2)
    for number in range(10):
        record(access, f"r{number:03d}", seconds=0.01)
        access.write_pending()
    access.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["access.log", "access.log.1", "access.log.2", "access.log.lock"]
    assert [len(lines_of(tmp_path / name)) for name in files[:3]] == [1, 3, 3]
    # The newest in the file, the older ones in .1, then .2; r000 to r002 rotated away.
    ids = [
        line.split()[1].removeprefix("request_id=")
        for name in ("access.log.2", "access.log.1", "access.log")
        for line in lines_of(tmp_path / name)
    ]
    assert ids == [f"r{number:03d}" for number in range(3, 10)]
    assert all(stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600 for name in files)


def test_a_batch_larger_than_the_size_is_spread_over_files(tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    line_bytes = len(text_line((AT, "r000", None, "chat", "chat", 200, 3, 5, 0.0, 0.01), None))
    access = AccessLog(path, names=no_names, max_bytes=2 * line_bytes, backups=5)
    for number in range(5):
        record(access, f"r{number:03d}")
    access.close()  # one batch of five lines
    assert [len(lines_of(tmp_path / name)) for name in ("access.log.2", "access.log.1")] == [2, 2]
    assert len(lines_of(path)) == 1


def test_a_file_moved_away_by_logrotate_is_followed(tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    access = AccessLog(path, names=no_names, max_bytes=0)
    record(access, "before")
    access.write_pending()
    path.rename(tmp_path / "access.log-20261207")
    record(access, "after")
    access.close()
    assert lines_of(tmp_path / "access.log-20261207")[0].split()[1] == "request_id=before"
    assert lines_of(path)[0].split()[1] == "request_id=after"


def _write_from_a_process(path: str, who: str, lines: int, max_bytes: int) -> None:
    access = AccessLog(Path(path), names=no_names, max_bytes=max_bytes, backups=1000)
    for number in range(lines):
        record(access, f"{who}-{number}", model="m" * 200)  # long lines: more room to cut
        if number % 7 == 0:
            access.write_pending()
    access.close()


def test_processes_sharing_the_file_never_cut_each_others_lines_or_rotate_over_each_other(
    tmp_path: Path,
) -> None:
    path = tmp_path / "access.log"
    each = 400
    fork = multiprocessing.get_context("fork")
    writers = [
        fork.Process(target=_write_from_a_process, args=(str(path), who, each, 16 * 1024))
        for who in ("a", "b", "c")
    ]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
        assert writer.exitcode == 0
    written = [line for file in tmp_path.glob("access.log*") for line in lines_of(file)]
    assert all(line.startswith("20") and line.endswith(" ms=10.0") for line in written)
    ids = sorted(line.split()[1] for line in written)
    expected = sorted(f"request_id={who}-{n}" for who in ("a", "b", "c") for n in range(each))
    assert ids == expected  # none lost to a rotation over another's, none twice
    assert all(file.stat().st_size <= 16 * 1024 for file in tmp_path.glob("access.log*"))


# -- key names -----------------------------------------------------------------------------------


def test_it_names_keys_looking_each_up_once(tmp_path: Path) -> None:
    asked: list[list[int]] = []

    def names(ids: Collection[int]) -> dict[int, str]:
        asked.append(sorted(ids))
        return {key_id: f"key {key_id}" for key_id in ids if key_id != 3}

    access = AccessLog(tmp_path / "access.log", names=names)
    for key_id in (1, 2, 1, 3, None):
        record(access, key_id=key_id)
    access.write_pending()
    for key_id in (1, 2, 3):
        record(access, key_id=key_id)
    access.close()
    assert asked == [[1, 2, 3]]  # a key not found (deleted) is not asked for again either
    keys = [line.split(" model=")[0].split(" key_id=")[1] for line in lines_of(access.path)]
    assert keys == [
        '1 key="key 1"',
        '2 key="key 2"',
        '1 key="key 1"',
        "3 key=-",
        "- key=-",
        '1 key="key 1"',
        '2 key="key 2"',
        "3 key=-",
    ]


def test_a_failed_lookup_leaves_the_id_and_is_tried_again_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def names(ids: Collection[int]) -> dict[int, str]:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("the database is away")
        return {7: "app"}

    access = AccessLog(tmp_path / "access.log", names=names)
    record(access, key_id=7)
    access.write_pending()
    record(access, key_id=7)
    access.write_pending()  # within NAMES_RETRY_SECONDS: not asked again
    monkeypatch.setattr(accesslog, "NAMES_RETRY_SECONDS", -1.0)
    record(access, key_id=7)
    access.close()
    assert len(calls) == 2
    assert [" key=app " in line for line in lines_of(access.path)] == [False, False, True]


@pytest.mark.django_db
def test_it_reads_key_names_from_the_database(keys: dict[str, str]) -> None:
    from access.models import GatewayKey

    alice = GatewayKey.objects.get(name="alice's app")
    assert accesslog.key_names([alice.id, 10**9]) == {alice.id: "alice's app"}


# -- settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            "LLMGW_ACCESS_LOG",
            "yes",
            "LLMGW_ACCESS_LOG='yes' is not an access log format: write text (the default, "
            "key=value words), json (one object a line) or off (no access log).",
        ),
        (
            "LLMGW_ACCESS_LOG_MAX_BYTES",
            "10MB",
            "LLMGW_ACCESS_LOG_MAX_BYTES='10MB' is not a number.",
        ),
        (
            "LLMGW_ACCESS_LOG_BACKUPS",
            "0",
            "LLMGW_ACCESS_LOG_BACKUPS='0' is below the smallest allowed value, 1.",
        ),
    ],
)
def test_a_bad_setting_stops_the_start_saying_why(
    name: str, value: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.process import Gateway as ProcessGateway

    monkeypatch.setenv(name, value)
    with pytest.raises(EnvError) as refused:
        ProcessGateway.started()
    assert str(refused.value) == message


def test_a_file_it_cannot_write_stops_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("LLMGW_ACCESS_LOG_FILE", str(tmp_path / "a-file" / "access.log"))
    with pytest.raises(EnvError) as refused:
        accesslog.from_settings()
    assert str(refused.value) == (
        f"LLMGW_ACCESS_LOG_FILE='{tmp_path}/a-file/access.log' cannot be written (File exists: "
        f"{tmp_path}/a-file): name a file the gateway may write, or set LLMGW_ACCESS_LOG=off."
    )


def test_the_settings_choose_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    from gateway import conf

    settings.VAR_DIR = tmp_path / "var"
    made = accesslog.from_settings()
    assert made is not None
    assert (made.path, made.form, made.max_bytes, made.backups) == (
        tmp_path / "var" / "log" / "gateway-access.log",
        "text",
        100 * 1024 * 1024,
        5,
    )
    made.close()
    monkeypatch.setenv("LLMGW_ACCESS_LOG", "JSON")
    monkeypatch.setenv("LLMGW_ACCESS_LOG_FILE", str(tmp_path / "elsewhere.log"))
    monkeypatch.setenv("LLMGW_ACCESS_LOG_MAX_BYTES", "0")
    made = accesslog.from_settings()
    assert made is not None
    assert (made.path, made.form, made.max_bytes) == (tmp_path / "elsewhere.log", "json", 0)
    made.close()
    monkeypatch.setenv("LLMGW_ACCESS_LOG_FILE", "logs/access.log")  # from the checkout
    assert conf.access_log_file() == Path(settings.BASE_DIR) / "logs" / "access.log"
    monkeypatch.setenv("LLMGW_ACCESS_LOG", "off")
    assert accesslog.from_settings() is None


# -- a gateway started as a worker starts ---------------------------------------------------------


@pytest.fixture
def worker(settings: Any, tmp_path: Path) -> Iterator[GatewayServer]:
    """A gateway started with its lifespan (Gateway.started: its access log made from the
    settings), its files in a var folder of the test's own."""
    settings.VAR_DIR = tmp_path / "var"
    settings.VAR_DIR.mkdir()
    running = GatewayServer(lifespan=True)
    yield running
    running.stop()


@pytest.mark.django_db(transaction=True)
def test_a_gateway_logs_each_request_with_its_key_model_status_and_tokens(
    worker: GatewayServer, catalog: Any, engine: FakeEngine, keys: dict[str, str], settings: Any
) -> None:
    catalog.add("chat")
    catalog.replica("chat", engine)
    gw = Gateway(worker.url, keys["alice"])
    answered = gw.post("/v1/completions", {"model": "chat", "prompt": "a"})
    assert answered.status_code == 200
    refused = requests.post(
        f"{worker.url}/v1/completions",
        json={"model": "chat", "prompt": "a"},
        headers={"Authorization": "Bearer not-a-key"},
        timeout=10,
    )
    assert refused.status_code == 401
    path = settings.VAR_DIR / "log" / "gateway-access.log"

    def line_of(request_id: str) -> str | None:
        found = [line for line in lines_of(path) if f" request_id={request_id} " in line]
        return found[0] if found else None

    line = wait_for(
        lambda: line_of(answered.headers["X-Request-ID"]), timeout=10, what="the answer's line"
    )
    assert ' key="alice\'s app" model=chat endpoint=completions status=200 ' in line
    assert " prompt_tokens=3 completion_tokens=5 " in line
    line = wait_for(
        lambda: line_of(refused.headers["X-Request-ID"]), timeout=10, what="the refusal's line"
    )
    assert " key_id=- key=- model=- endpoint=completions status=401 " in line
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.django_db(transaction=True)
def test_a_gateway_that_stops_writes_its_last_lines(
    keys: dict[str, str], settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its writer waits an hour between looks: only the stop can write these lines.
    monkeypatch.setattr(accesslog, "WRITE_SECONDS", 3600.0)
    settings.VAR_DIR = tmp_path / "var"
    settings.VAR_DIR.mkdir()
    running = GatewayServer(lifespan=True)
    ids = []
    try:
        for _ in range(3):
            answered = Gateway(running.url, keys["bob"]).get("/v1/models")
            assert answered.status_code == 200
            ids.append(answered.headers["X-Request-ID"])
        assert lines_of(settings.VAR_DIR / "log" / "gateway-access.log") == []
    finally:
        running.stop()
    written = lines_of(settings.VAR_DIR / "log" / "gateway-access.log")
    assert [line.split()[1] for line in written] == [f"request_id={i}" for i in ids]
    assert all(
        ' key="bob\'s app" model=- endpoint=models status=200 ' in line for line in written
    ), written

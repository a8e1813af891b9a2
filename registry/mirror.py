"""The mirror: registry files fetched at a commit into <root>/<org>/<repo>/<commit>/<path>.

Each file is streamed to a temporary name beside its place, hashed as it comes,
checked against the registry's sha256 (or git blob id for small plain files),
and only then renamed into place and recorded, so an interrupted or corrupted
fetch never leaves a file that looks complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import requests
from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from catalog.config import current_config
from catalog.models import Model, repository_file_sources
from core import diskspace
from core.metrics import control_metrics
from core.outbound import URLRefused
from core.refusals import Refused
from llmgw.download import BadStatus, WrongDigest, WrongSize, download_verified
from llmgw.units import format_bytes

from . import holders
from .hub import Registry
from .mirror_files import mirror_url
from .models import RENEW_SECONDS, Fetch, MirrorFile, Rollout

log = logging.getLogger("registry.mirror")

PROGRESS_EVERY_SECONDS = 0.5
# How long a fetch tries its database writes again while the database is away. Past
# LEASE_SECONDS another worker may have taken the fetch over: each try first checks that the
# lease is still this worker's.
DATABASE_RETRY_SECONDS = 30


class FetchFailed(Exception):
    pass


class LeaseLost(Exception):
    """Another worker took the fetch over (this one's lease lapsed): this one stops."""


def root() -> Path:
    return Path(current_config().mirror_root)


def relative_path(repo: str, commit: str, path: str) -> str:
    return f"{repo}/{commit}/{path}"


def file_url(repo: str, commit: str, path: str) -> str:
    return mirror_url(relative_path(repo, commit, path))


def local_path(repo: str, commit: str, path: str) -> Path:
    return root() / relative_path(repo, commit, path)


def parse_mirror_url(url: str) -> tuple[str, str, str] | None:
    """(repo, commit, path) of a mirror URL, or None when it is not one."""
    prefix = f"{settings.LLMGW_PUBLIC_URL}/mirror/"
    if not url.startswith(prefix):
        return None
    parts = url[len(prefix) :].split("/")
    if len(parts) < 4:
        return None
    return f"{parts[0]}/{parts[1]}", parts[2], "/".join(parts[3:])


def origin_for_source(
    url: str, mmproj: str = "", files: list[str] | None = None
) -> dict[str, Any] | None:
    """A source in the mirror has a known origin: the mirror recorded where it fetched the file.
    With a vision projector (`mmproj`, its path in the repository) or a snapshot's other files
    (`files`) fetched at the same commit, the origin lists them too, so that the update check
    follows every file."""
    parsed = parse_mirror_url(url)
    if parsed is None:
        return None
    repo, commit, path = parsed
    record = MirrorFile.objects.filter(repo=repo, commit=commit, path=path).first()
    if record is None:
        return None
    entries = [{"path": path, "sha256": record.sha256, "size": record.size}]
    besides = ([mmproj] if mmproj else []) + list(files or [])
    found = {
        f.path: f for f in MirrorFile.objects.filter(repo=repo, commit=commit, path__in=besides)
    }
    for other in besides:
        if other in found:
            entries.append(
                {"path": other, "sha256": found[other].sha256, "size": found[other].size}
            )
    fetch = (
        Fetch.objects.filter(repo=repo, commit=commit, state=Fetch.DONE)
        .order_by("-created_at")
        .first()
    )
    return {
        "repo": repo,
        "branch": fetch.branch if fetch else "main",
        "commit": commit,
        "files": entries,
    }


# -- running a fetch -------------------------------------------------------------


def claim_fetch(fetch_id: int) -> bool:
    """Take the fetch for this worker process: queued, or running with its lease lapsed
    (Fetch.claim)."""
    return Fetch.claim(fetch_id, holder=holders.this_process())


def download(fetch_id: int, *, claimed: bool = False) -> bool:
    """Bring a fetch's files in (done) or give up on them (failed); False when another worker
    holds the fetch or it is finished, so this one did nothing. `claimed`: the caller claimed
    it already (claim_fetch).

    The database going away meanwhile (PostgreSQL restarting) does not end it: its progress is
    written when it can be, and what must be written (a file's record, the end) is tried again
    for up to DATABASE_RETRY_SECONDS, files already in place kept. Without that the fetch was
    left running with nobody on it, taken again only once its lease lapsed."""
    if not claimed and not claim_fetch(fetch_id):
        return False
    deadline = time.monotonic() + DATABASE_RETRY_SECONDS
    while True:
        try:
            return _download_claimed(fetch_id)
        except DatabaseError as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("fetch %s: the database failed (%s); trying again", fetch_id, exc)
            _drop_broken_connection()
            time.sleep(1)


def _download_claimed(fetch_id: int) -> bool:
    fetch = Fetch.objects.get(pk=fetch_id)
    if fetch.state != Fetch.RUNNING or fetch.holder != holders.this_process():
        # Taken over while the database was away (the lease lapsed), or ended by the other.
        log.info("fetch %s is another worker's now; this one leaves it", fetch_id)
        return False
    board = control_metrics()
    started = time.monotonic()
    with LeaseKeeper(fetch) as lease:
        try:
            _download_all(fetch, lease)
        except LeaseLost:
            log.warning("fetch %s was taken over by another worker; this one stops", fetch_id)
            return False
        except FetchFailed as exc:
            if fetch.fail(str(exc)):
                log.warning("fetch %s failed: %s", fetch.pk, exc)
                board.fetches.labels("failed").inc()
            return True
        finally:
            board.fetch_seconds.observe(time.monotonic() - started)
    if fetch.finish():
        board.fetches.labels("done").inc()
    return True


class LeaseKeeper:
    """Renews a fetch's lease every RENEW_SECONDS from a thread of its own while the fetch runs,
    so that a download that stalls for a while (a slow registry) keeps it, and tells when it was
    lost (check raises LeaseLost). Progress renews it too (Fetch.beat).

    Why a thread: the lease is short (LEASE_SECONDS) so that a dead worker's fetch is taken over
    soon, and progress alone comes at the network's pace. Inside a transaction (a test's) the
    thread, which has a connection of its own, would not see the claim: progress renews alone."""

    def __init__(self, fetch: Fetch) -> None:
        self.fetch = fetch
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> LeaseKeeper:
        if not connection.in_atomic_block:
            self._thread = threading.Thread(
                target=self._keep, name=f"fetch-{self.fetch.pk}-lease", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _keep(self) -> None:
        try:
            while not self._stop.wait(RENEW_SECONDS):
                try:
                    if not self.fetch.renew():
                        self.lost.set()
                        return
                except DatabaseError as exc:
                    # Not lost yet: renewed again once the database answers, if still ours.
                    log.warning("fetch %s: lease not renewed (%s)", self.fetch.pk, exc)
                    connection.close()
        finally:
            connection.close()  # this thread's own

    def check(self) -> None:
        """Raise LeaseLost once another worker holds the fetch."""
        if self.lost.is_set():
            raise LeaseLost

    def progress(self, bytes_done: int, *, message: str | None = None) -> None:
        """Write progress (renewing the lease); raise LeaseLost when the lease is lost."""
        self.check()
        if not self.fetch.beat(bytes_done, message=message):
            self.lost.set()
            raise LeaseLost


def _drop_broken_connection() -> None:
    """Close this thread's database connection after an error, so that the next query opens a
    new one (a connection PostgreSQL terminated stays broken); not inside a transaction, which
    its owner rolls back."""
    if not connection.in_atomic_block:
        connection.close()


def _download_all(fetch: Fetch, lease: LeaseKeeper) -> None:
    registry = Registry()
    with registry.session() as session:
        _download_files(fetch, registry, session, lease)


def _download_files(
    fetch: Fetch, registry: Registry, session: requests.Session, lease: LeaseKeeper
) -> None:
    done = 0
    progress = _FetchProgress(lease)
    missing = []
    for entry in fetch.files:
        lease.check()
        target = local_path(fetch.repo, fetch.commit, entry["path"])
        if _already_here(fetch, entry, target):
            done += entry["size"]
            continue
        if _link_same_content(fetch, entry, target):
            done += entry["size"]
            continue
        missing.append((entry, target))
    # Before the first byte: a fetch that cannot fit fails now, with the figures, rather than
    # when the disk is full (and the database, the logs and the rest of var/ with it).
    why = room_shortfall(sum(entry["size"] for entry, _ in missing))
    if why is not None:
        names = ", ".join(entry["path"] for entry, _ in missing)
        raise FetchFailed(f"not enough disk space for {names}: {why}; nothing was fetched")
    for entry, target in missing:
        lease.check()
        target.parent.mkdir(parents=True, exist_ok=True)
        url = registry.file_url(fetch.repo, fetch.commit, entry["path"])
        size = _download_file(
            fetch, entry, url, target, registry, session, progress.of_file(entry["path"], done)
        )
        control_metrics().fetch_bytes.inc(size)
        done += size
        record_change(fetch, entry, url)
        lease.progress(done)


class _FetchProgress:
    """Writes a fetch's progress to its row, at most every PROGRESS_EVERY_SECONDS; stops the
    download (LeaseLost) as soon as another worker holds the fetch."""

    def __init__(self, lease: LeaseKeeper) -> None:
        self.lease = lease
        self.fetch = lease.fetch
        self.last = time.monotonic()

    def of_file(self, path: str, before: int) -> Callable[[int, int | None], None]:
        """The progress callback for one file, the fetch's files before it ``before`` bytes."""

        def report(size: int, _total: int | None) -> None:
            self.lease.check()
            if time.monotonic() - self.last > PROGRESS_EVERY_SECONDS:
                self.last = time.monotonic()
                try:
                    self.lease.progress(before + size, message=f"fetching {path}")
                except DatabaseError as exc:
                    # Progress is shown when it can be: the download goes on.
                    log.warning("fetch %s: progress not written (%s)", self.fetch.pk, exc)
                    _drop_broken_connection()

        return report


def _download_file(
    fetch: Fetch,
    entry: dict[str, Any],
    url: str,
    target: Path,
    registry: Registry,
    session: requests.Session,
    progress: Callable[[int, int | None], None],
) -> int:
    """One file of the fetch into its place, checked against the registry; returns its size."""
    # Small plain files have no sha256 in the registry, only a git blob id (sha1).
    sha256 = entry.get("sha256")
    try:
        size, _ = download_verified(
            url,
            into=target.parent,
            name=f".{target.name}.",
            place=lambda partial, _digest: os.replace(partial, target),
            get=session.get,
            headers=registry.headers,
            timeout=(10, 120),
            algorithm="sha256" if sha256 else "sha1",
            prefix=b"" if sha256 else f"blob {entry['size']}\0".encode(),
            expected_digest=sha256 or entry.get("blob_id"),
            expected_size=entry["size"],
            progress=progress,
        )
    except BadStatus as exc:
        raise FetchFailed(
            f"the registry answered {exc.status} for {entry['path']} at {fetch.commit[:12]}"
        ) from None
    except WrongSize as exc:
        raise FetchFailed(
            f"{entry['path']} came to {exc.size} bytes, but the registry lists {exc.expected}; nothing was kept"
        ) from None
    except WrongDigest as exc:
        if sha256:
            raise FetchFailed(
                f"sha256 mismatch for {entry['path']}: the registry says {sha256}, the download is {exc.digest}; "
                "nothing was kept"
            ) from None
        raise FetchFailed(
            f"{entry['path']} does not match the registry's git blob id; nothing was kept"
        ) from None
    except URLRefused as exc:
        raise FetchFailed(f"the download of {entry['path']} was refused: {exc}") from None
    except requests.RequestException as exc:
        raise FetchFailed(f"the download of {entry['path']} from {url} broke off: {exc}") from None
    except OSError as exc:
        if diskspace.disk_full(exc) is None:
            raise
        # The part downloaded is gone already (download_verified removes it).
        found = diskspace.room(target.parent)
        raise FetchFailed(
            f"the disk filled while {entry['path']} was fetched"
            + (f" ({found.text()})" if found else "")
            + "; what was downloaded of it was removed"
        ) from None
    if not sha256:
        # Small plain files (no LFS): their sha256, which nodes verify against, is worked out
        # here and recorded as the file's.
        with target.open("rb") as handle:
            entry["sha256"] = hashlib.file_digest(handle, "sha256").hexdigest()
    return size


# A fetch leaves at least this much free on the mirror's disk: in the run command's var/ the
# database, the logs and the node's cache share it.
FETCH_RESERVE_BYTES = 64 * 1024 * 1024


def room_shortfall(needed: int) -> str | None:
    """Why `needed` more bytes will not fit in the mirror, in figures; None when they do (or
    when its disk cannot be measured from here)."""
    if needed == 0:
        return None  # linked or in place already: no room taken
    found = diskspace.room(root())
    if found is None or needed + FETCH_RESERVE_BYTES <= found.free:
        return None
    return (
        f"they take {format_bytes(needed)} and the mirror's disk has {format_bytes(found.free)} "
        f"free ({found.path}, of {format_bytes(found.total)}), {format_bytes(FETCH_RESERVE_BYTES)} "
        "of which is kept for the database and the logs"
    )


def refuse_past_mirror_room(doing: str, repo: str, files: list[dict[str, Any]]) -> None:
    """Refuse `doing` (507) when the files of `repo` it would fetch into the mirror do not fit
    there; a file the mirror holds already, at any commit, is linked and takes no room."""
    known = set(
        MirrorFile.objects.filter(
            repo=repo, sha256__in=[f["sha256"] for f in files if f.get("sha256")]
        ).values_list("sha256", flat=True)
    )
    new = [f for f in files if not f.get("sha256") or f["sha256"] not in known]
    why = room_shortfall(sum(f["size"] for f in new))
    if why is None:
        return
    names = ", ".join(f["path"] for f in new)
    raise Refused(
        f"Cannot {doing}: not enough disk space for {names}: {why}. Nothing was fetched. Free "
        "space there (models no longer served: `llmgw ctl model remove NAME`, after which the "
        "mirror deletes the files nothing else uses), then try again.",
        code="disk_full",
        status=507,
    )


def _already_here(fetch: Fetch, entry: dict[str, Any], target: Path) -> bool:
    record = MirrorFile.objects.filter(
        repo=fetch.repo, commit=fetch.commit, path=entry["path"]
    ).first()
    return record is not None and target.exists() and target.stat().st_size == record.size


def _link_same_content(fetch: Fetch, entry: dict[str, Any], target: Path) -> bool:
    """A file unchanged since another commit is linked, not downloaded again."""
    if not entry.get("sha256"):
        return False
    for record in MirrorFile.objects.filter(
        repo=fetch.repo, path=entry["path"], sha256=entry["sha256"]
    ):
        existing = local_path(record.repo, record.commit, record.path)
        if existing.exists() and existing.stat().st_size == entry["size"]:
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                os.link(existing, target)
            record_change(fetch, entry, record.source_url)
            return True
    return False


def record_change(fetch: Fetch, entry: dict[str, Any], url: str) -> None:
    MirrorFile.objects.update_or_create(
        repo=fetch.repo,
        commit=fetch.commit,
        path=entry["path"],
        defaults={"sha256": entry["sha256"], "size": entry["size"], "source_url": url},
    )


# -- cleaning ---------------------------------------------------------------------


def referenced_files() -> set[tuple[str, str, str]]:
    """Files a model, a model's previous revision, or a fetch or rollout under way still refers to."""
    keep: set[tuple[str, str, str]] = set()
    names = set()
    for name, source, previous, mmproj, files in Model.objects.values_list(
        "name", "source", "previous", "mmproj", "files"
    ):
        names.add(name)
        for url in (source, (previous or {}).get("source")):
            # A revision's vision projector and other files are kept with its weights.
            urls = [url, *repository_file_sources(url, mmproj, files)] if url else []
            for kept in urls:
                parsed = parse_mirror_url(kept) if kept else None
                if parsed:
                    keep.add(parsed)
    # A serve's fetch is done a moment before its model is added (registry.fetches.run_fetch):
    # the files of one that finished lately, its model not there, are kept as though the fetch
    # were still under way.
    lately = timezone.now() - timedelta(minutes=10)
    for fetch in Fetch.objects.under_way() | Fetch.objects.filter(
        state=Fetch.DONE, serve_definition__isnull=False, finished_at__gte=lately
    ):
        if fetch.state == Fetch.DONE and (fetch.serve_definition or {}).get("name") in names:
            continue
        keep.update((fetch.repo, fetch.commit, f["path"]) for f in fetch.files)
    for rollout in Rollout.objects.active().select_related("model"):
        mmproj, files = rollout.model.mmproj, rollout.model.files
        for url in (rollout.from_source, rollout.to_source):
            urls = [url, *repository_file_sources(url, mmproj, files)] if url else []
            for kept in urls:
                parsed = parse_mirror_url(kept) if kept else None
                if parsed:
                    keep.add(parsed)
    return keep


def clean_mirror() -> list[str]:
    """Delete the mirror's files nothing refers to; returns what was deleted."""
    keep = referenced_files()
    removed = []
    with transaction.atomic():
        for record in MirrorFile.objects.select_for_update():
            key = (record.repo, record.commit, record.path)
            if key in keep:
                continue
            local_path(*key).unlink(missing_ok=True)
            removed.append(record.relative_path)
            record.delete()
    for folder in sorted(root().glob("*/*/*"), key=lambda p: len(p.parts), reverse=True):
        if folder.is_dir() and not any(folder.rglob("*")):
            # Another cleaning may have removed it, or a fetch put a file in it, meanwhile.
            with contextlib.suppress(OSError):
                folder.rmdir()
    return removed

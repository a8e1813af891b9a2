"""A plain user's share of the mirror: what their serves and updates may bring into it, so that
no one user can fill the control plane's disk (LLMGW_SERVE_QUOTA_GB; staff, server.yaml and the
system have none, and a quota of 0 leaves serving to staff).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from core.actor import Actor
from core.refusals import conflict, forbidden
from llmgw.units import format_bytes

from .models import Fetch, MirrorFile

# The setting's unit, as memory_gb's and llmgw.units.format_bytes's: 1024**3 bytes.
GB = 1024**3

# One copy of a file in the mirror: (repo, path, sha256). The mirror links a file unchanged
# between two commits of a repository rather than fetch it again, so the commit is not part of
# it; it stands in for the sha256 where the registry lists none (small plain files).
FileKey = tuple[str, str, str]


def file_key(repo: str, commit: str, entry: dict[str, Any]) -> FileKey:
    """The key of a file as a fetch lists it ({path, size, sha256 or blob_id})."""
    return (repo, entry["path"], entry.get("sha256") or commit)


def mirror_files_held(user: Any) -> dict[FileKey, int]:
    """The files counted against the user's quota, with their sizes.

    Every file one of their fetches asked for that is still in the mirror, and the files of
    their fetches still queued or running, each once. A file someone else's serve also holds
    counts for each of them: when the other's model goes, this user's alone keeps it. A file
    leaves the count when the mirror deletes it (registry.mirror.clean_mirror). All of it is
    worked out from the fetches and the mirror's records: nothing new is stored."""
    asked: dict[tuple[str, str, str], FileKey] = {}  # (repo, commit, path) -> its key
    held: dict[FileKey, int] = {}
    for repo, commit, files, state in Fetch.objects.filter(requested_by=user).values_list(
        "repo", "commit", "files", "state"
    ):
        for entry in files:
            asked[(repo, commit, entry["path"])] = file_key(repo, commit, entry)
            if state in Fetch.UNDER_WAY:
                held[file_key(repo, commit, entry)] = entry["size"]
    repos = {repo for repo, _, _ in asked}
    for repo, commit, path, size in MirrorFile.objects.filter(repo__in=repos).values_list(
        "repo", "commit", "path", "size"
    ):
        key = asked.get((repo, commit, path))
        if key is not None:
            held[key] = size
    return held


def refuse_past_serve_quota(actor: Actor, doing: str, files: dict[FileKey, int]) -> None:
    """Refuse `doing` (say, "serve ORG/NAME") when fetching `files` takes a plain user past
    their quota. Called under the catalog lock, so two serves of one user are counted in turn."""
    if actor.user is None or actor.is_staff:
        return
    quota_gb = settings.LLMGW_SERVE_QUOTA_GB
    if quota_gb == 0:
        raise forbidden(
            f"Cannot {doing}: serving from the registry is left to staff here "
            "(LLMGW_SERVE_QUOTA_GB is 0). Ask a staff user to serve it for you, or the operator "
            "to set a quota."
        )
    quota = int(quota_gb * GB)
    held = mirror_files_held(actor.user)
    used = sum(held.values())
    new = {key: size for key, size in files.items() if key not in held}
    adding = sum(new.values())
    if used + adding <= quota:
        return
    listed = ", ".join(f"{path} ({format_bytes(size)})" for (_, path, _), size in new.items())
    raise conflict(
        f"Cannot {doing}: it would bring {listed} into the mirror, and the files your serves "
        f"hold there already come to {format_bytes(used)} of your quota of {format_bytes(quota)} "
        "(LLMGW_SERVE_QUOTA_GB). Remove models of yours that you no longer use "
        "(`llmgw ctl model remove NAME`; the mirror then deletes the files nothing else uses), "
        "or ask a staff user to do it for you, or the operator to raise LLMGW_SERVE_QUOTA_GB.",
        code="serve_quota",
    )

"""The registry: any Hugging Face-compatible hub, through huggingface_hub.

Every call names an explicit revision (a branch or a commit): an unpinned call
would race with pushes. Requests are counted, so that the update check can show
it asks once per repository and branch. Every request to the registry, and every
redirect hop of it, is checked by `core.outbound` against `registry_policy()`.
"""

from __future__ import annotations

import fnmatch
import threading
from dataclasses import dataclass

import requests
from huggingface_hub import HfApi, hf_hub_url
from huggingface_hub.utils import _http as hf_http

from catalog.config import current_config
from core.outbound import HostPolicy, endpoint_hosts, guarded_session, httpx_request_hook


class RegistryError(Exception):
    pass


class UnknownRepository(RegistryError):
    """The registry answered that it has no such repository: the asker's mistake."""


def registry_policy() -> HostPolicy:
    """The registry's own hosts (see `endpoint_hosts`) and the sources' allow-list."""
    config = current_config()
    allowed = dict.fromkeys(
        (*endpoint_hosts(config.registry_endpoint), *config.source_allowed_hosts())
    )
    return HostPolicy(
        tuple(allowed),
        setting="sources.allowed_hosts in server.yaml (nor LLMGW_SOURCE_ALLOWED_HOSTS) nor "
        "registry.endpoint",
    )


# huggingface_hub's client waits forever by default: a registry that takes the connection and
# never answers would hold a web worker (serve) or the update check for good.
TIMEOUT_SECONDS = 30.0


def _guarded_client_factory() -> object:
    """huggingface_hub's client, with every request and redirect hop checked against the
    policy, and every wait bounded."""
    client = hf_http.default_client_factory()
    client.event_hooks["request"].append(httpx_request_hook(registry_policy))
    client.timeout = type(client.timeout)(TIMEOUT_SECONDS, connect=10.0)
    return client


_guard_installed = threading.Lock()
_guarded = False


def _install_guard() -> None:
    """huggingface_hub keeps one client per process; it is made through our factory."""
    global _guarded
    with _guard_installed:
        if not _guarded:
            hf_http.set_client_factory(_guarded_client_factory)  # type: ignore[arg-type]
            _guarded = True


class UnknownBranch(RegistryError):
    """The repository answered, but has no such branch: the asker's mistake, not the registry's."""


@dataclass(frozen=True)
class RegistryFile:
    path: str
    size: int
    sha256: str | None  # LFS files carry one; small plain files only a git blob id
    blob_id: str | None

    def as_dict(self) -> dict[str, object]:
        return {
            "path": self.path,
            "size": self.size,
            "sha256": self.sha256,
            "blob_id": self.blob_id,
        }


class Registry:
    def __init__(self, endpoint: str | None = None, token: str | None = None) -> None:
        _install_guard()
        config = current_config()
        self.endpoint = (endpoint or config.registry_endpoint).rstrip("/")
        self.api = HfApi(
            endpoint=self.endpoint,
            token=token if token is not None else (config.registry_token or None),
        )
        self.requests = 0
        self._lock = threading.Lock()

    def _count(self) -> None:
        with self._lock:
            self.requests += 1

    def _fail(self, repo: str, what: str, exc: Exception) -> RegistryError:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return RegistryError(
            f"the registry at {self.endpoint} could not {what} for {repo}: {detail}"
        )

    def branch_heads(self, repo: str) -> dict[str, str]:
        """Every branch of a repository and the commit it points at (one request)."""
        self._count()
        try:
            refs = self.api.list_repo_refs(repo)
        except Exception as exc:  # httpx errors, HTTP errors, bad answers: all mean "not now"
            response = getattr(exc, "response", None)
            if getattr(response, "status_code", None) in (401, 404):
                # The hub answers 401 for a repository that does not exist (or is private).
                raise UnknownRepository(
                    f"the registry at {self.endpoint} has no repository {repo} (or it is "
                    "private and registry.token cannot read it)"
                ) from None
            raise self._fail(repo, "list the branches", exc) from None
        return {branch.name: branch.target_commit for branch in refs.branches}

    def branch_head(self, repo: str, branch: str) -> str:
        heads = self.branch_heads(repo)
        if branch not in heads:
            raise UnknownBranch(
                f"{repo} has no branch {branch!r}; its branches are {', '.join(sorted(heads)) or 'none'}"
            )
        return heads[branch]

    def files(self, repo: str, commit: str) -> list[RegistryFile]:
        """Every file of the repository at a commit, with sizes and checksums (one request)."""
        self._count()
        try:
            entries = list(self.api.list_repo_tree(repo, revision=commit, recursive=True))
        except Exception as exc:  # httpx errors, HTTP errors, bad answers: all mean "not now"
            raise self._fail(repo, f"list the files at {commit[:12]}", exc) from None
        return [_registry_file(e) for e in entries if hasattr(e, "size")]

    def paths(self, repo: str, commit: str, paths: list[str]) -> list[RegistryFile]:
        """Just these files at a commit (one request); a path missing there is left out."""
        self._count()
        try:
            entries = self.api.get_paths_info(repo, paths, revision=commit)
        except Exception as exc:  # httpx errors, HTTP errors, bad answers: all mean "not now"
            raise self._fail(repo, f"read {', '.join(paths)} at {commit[:12]}", exc) from None
        return [_registry_file(e) for e in entries if hasattr(e, "size")]

    def session(self) -> requests.Session:
        """A session for downloading the registry's files, checked like its API calls."""
        return guarded_session(registry_policy())

    def file_url(self, repo: str, commit: str, path: str) -> str:
        return hf_hub_url(repo, path, revision=commit, endpoint=self.endpoint)

    @property
    def headers(self) -> dict[str, str]:
        token = self.api.token
        return {"Authorization": f"Bearer {token}"} if isinstance(token, str) and token else {}


def _registry_file(entry: object) -> RegistryFile:
    lfs = getattr(entry, "lfs", None)
    return RegistryFile(
        path=entry.path,  # type: ignore[attr-defined]
        size=int(entry.size),  # type: ignore[attr-defined]
        sha256=getattr(lfs, "sha256", None) if lfs is not None else None,
        blob_id=getattr(entry, "blob_id", None),
    )


def match_files(files: list[RegistryFile], pattern: str) -> list[RegistryFile]:
    return [f for f in files if fnmatch.fnmatch(f.path, pattern)]

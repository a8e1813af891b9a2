"""Bearer secrets: people's API tokens, gateway keys and node tokens, made and kept one way.

Each is a prefix that says what it opens ("llmgw_" API tokens, "llmgw-" gateway keys,
"llmgw-node-" node tokens), then random characters; the database keeps only :func:`digest`.
This module must not import Django: it is the lowest layer's.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass

#: Characters in a digest: the stored hash columns (ApiToken.digest, GatewayKey.key_hash,
#: Node.token_hash) are this long.
DIGEST_LENGTH = 64


def digest(secret: str) -> str:
    """What the database keeps of a secret: the SHA-256 hex digest of its UTF-8 text.

    One round is enough: a secret of 24 or 32 random bytes cannot be guessed, so a slow password
    hash would protect nothing more and cost every request; a lookup stays one indexed equality.

    surrogateescape: a secret read from argv or the environment with bytes that are not UTF-8
    hashes (to a digest no row has) instead of raising; every other string encodes exactly as
    before, so stored digests still match.
    """
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()


@dataclass(frozen=True)
class BearerKind:
    """One kind of bearer secret: its prefix, how much of it is kept in clear, its randomness."""

    what: str
    prefix: str
    shown: int  # characters kept in clear (the prefix column); 0 for none
    random_part: Callable[[], str]

    def new(self) -> str:
        """A new secret of this kind; the caller stores only digest() and shown_part()."""
        return self.prefix + self.random_part()

    def shown_part(self, secret: str) -> str:
        return secret[: self.shown]

    def is_one(self, secret: str) -> bool:
        """Whether ``secret`` is of this kind by its look (its digest decides whether it opens
        anything)."""
        return secret.startswith(self.prefix)


API_TOKEN = BearerKind("API token", "llmgw_", 12, lambda: secrets.token_hex(24))
GATEWAY_KEY = BearerKind("gateway key", "llmgw-", 12, lambda: secrets.token_urlsafe(32))
NODE_TOKEN = BearerKind("node token", "llmgw-node-", 0, lambda: secrets.token_urlsafe(32))

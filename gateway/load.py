"""Requests in flight per replica, counted over every gateway process of this machine.

A request goes to the replica with the fewest requests in flight: counted by one process
alone, two workers would each see an idle replica and both send to it. So each process counts
its own in its board (gateway.boards: one int32 per slot, a replica's slot a stable hash of its
id), and choosing adds up every live process's. A worker that dies takes its counts with it.
Two replicas whose ids share a slot share a count: with 4,096 slots and a few dozen replicas
that is rare, and makes the choice a little less even, never wrong. Other machines balance
their own share, which the load balancer in front spreads evenly.
"""

from __future__ import annotations

import zlib
from pathlib import Path

from .boards import Board

SLOTS = 4096
COUNTER_BYTES = 4
LAYOUT = 1  # of the board's body: SLOTS int32 counters


def slot_of(replica_id: str) -> int:
    return zlib.crc32(replica_id.encode()) % SLOTS


class SharedLoad:
    """This process's counts, written where the other processes read them."""

    def __init__(self, folder: Path | None, *, pid: int | None = None) -> None:
        self.board = Board(folder, "load", SLOTS * COUNTER_BYTES, layout=LAYOUT, fmt="i", pid=pid)

    def add(self, replica_id: str, delta: int) -> None:
        slot, mine = slot_of(replica_id), self.board.body
        mine[slot] = max(0, mine[slot] + delta)

    def mine(self, replica_id: str) -> int:
        return int(self.board.body[slot_of(replica_id)])

    def total(self, replica_id: str, now: float) -> int:
        """Requests in flight on the replica, counted over every gateway process here."""
        slot, board = slot_of(replica_id), self.board
        board.rescan(now)
        return int(board.body[slot]) + sum(other.body[slot] for other in board.others.values())

    def close(self) -> None:
        self.board.close()

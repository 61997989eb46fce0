"""Admission of requests against a budget of bytes in flight (the retrieval server's memory bound).

A request first reserves what it may hold at most (its *charge*, estimated from its size before any work is
done); it is admitted at once when the charge fits beside what is already in flight, else it waits in arrival
order (a large request is not starved by a stream of small ones) and gives up after a timeout (the server then
answers 503 with ``Retry-After``). The charge is released when the answer has been sent.

All calls are made from one asyncio event loop (the server's); nothing here is thread-safe, nothing needs to be.
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["MemoryBudget"]


class MemoryBudget:
    """``capacity`` bytes shared by the requests in flight, admitted first come, first served."""

    def __init__(self, capacity: int, name: str = "budget") -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"{name}: expected a positive number of bytes, got {capacity!r}")
        self.capacity = capacity
        self.name = name
        self.used = 0
        self.peak = 0
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    def __repr__(self) -> str:
        return f"MemoryBudget({self.name}: {self.used} of {self.capacity} bytes, {len(self._waiting)} waiting)"

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def acquire(self, charge: int, timeout_s: float) -> bool:
        """Reserve ``charge`` bytes, waiting at most ``timeout_s`` behind earlier requests; False if not admitted
        in time. ValueError for a charge larger than the whole capacity (it could never be admitted)."""
        if charge > self.capacity:
            raise ValueError(f"{self.name}: a charge of {charge} bytes exceeds the capacity of {self.capacity}")
        if not self._waiting and self.used + charge <= self.capacity:
            self._take(charge)
            return True
        entry = (charge, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            await asyncio.wait({entry[1]}, timeout=timeout_s)
        except BaseException:  # cancelled (the client went away) while waiting
            self._leave(entry)
            raise
        if entry[1].done():
            return True
        self._leave(entry)
        return False

    def _leave(self, entry: tuple[int, asyncio.Future[None]]) -> None:
        if entry[1].done():  # admitted just as its caller stopped waiting: give the bytes back
            self.release(entry[0])
            return
        self._waiting.remove(entry)
        entry[1].cancel()
        self._admit()  # the head may have left: those behind it can go

    def release(self, charge: int) -> None:
        """Give back ``charge`` bytes of an admitted request and admit those waiting that now fit."""
        self.used -= charge
        if self.used < 0:
            raise RuntimeError(f"{self.name}: released more than was reserved")
        self._admit()

    def _take(self, charge: int) -> None:
        self.used += charge
        self.peak = max(self.peak, self.used)

    def _admit(self) -> None:
        while self._waiting and self.used + self._waiting[0][0] <= self.capacity:
            charge, fut = self._waiting.popleft()
            self._take(charge)
            fut.set_result(None)

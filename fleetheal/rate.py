"""The one token bucket: how the launcher, the agent's job-output judge and its owner lookups keep a ceiling on
work that a job (or whoever writes to the agent) controls."""

from __future__ import annotations


class TokenBucket:
    """`per_s` tokens a second, holding at most a second's worth; full at `now`. Every call names the time
    (a monotonic clock, or a test's), so the bucket has no clock of its own."""

    __slots__ = ("at", "per_s", "tokens")

    def __init__(self, per_s: float, now: float) -> None:
        self.per_s = float(per_s)
        self.tokens = self.per_s
        self.at = now

    def has(self, now: float, n: float = 1.0) -> bool:
        """Whether `n` tokens are there at `now` (refilled for the time since the last call)."""
        self.tokens = min(self.per_s, self.tokens + (now - self.at) * self.per_s)
        self.at = now
        return self.tokens >= n

    def take(self, now: float, n: float = 1.0) -> bool:
        """Spend `n` when there are that many (True); nothing when not (False)."""
        if not self.has(now, n):
            return False
        self.tokens -= n
        return True

    def spend(self, now: float, n: float) -> None:
        """Spend `n` whatever is left: a debt of at most a second's worth, which the next seconds repay."""
        self.has(now)
        self.tokens = max(-self.per_s, self.tokens - n)

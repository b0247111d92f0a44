"""How much a decode node's running batch may still be stalled by decode-local prefills (pure state).

A decode-local turn prefills its suffix inside D's engine steps, and the part of that prefill that does not
hide under a memory-bound decode step delays every request decoding there (``costpolicy``'s *stall*). If
local prefills stall D for a share ``s`` of its time, every running request's TPOT rises by about ``s``:
the budget is that share, the natural form of a TPOT objective ("local turns may slow decoding by at most
4 %"). It is a token bucket of stall seconds: it refills at ``share`` seconds per second up to a burst of
``share × window_s`` (so over any window of that length the stall stays near the share, which is what a
request decoding for that long sees), and each decode-local turn spends its estimated stall.

``credit`` is what the cost policy reads; the shell spends when it sends a local turn. No clock, no I/O:
``now`` comes from the caller's monotonic clock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StallBudget:
    share: float  # of D's time that local prefills may stall its running batch
    window_s: float  # the burst is share × window_s
    level_s: float  # stall seconds available at `at` (negative: spent ahead, e.g. a forced local turn)
    at: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0 or self.window_s <= 0.0:
            raise ValueError("share must be in [0, 1] and window_s > 0")

    @classmethod
    def full(cls, share: float, window_s: float, now: float) -> StallBudget:
        return cls(share, window_s, share * window_s, now)

    @property
    def burst_s(self) -> float:
        return self.share * self.window_s

    def credit(self, now: float) -> float:
        """Stall seconds available now (the bucket refilled since `at`, capped at the burst)."""
        return min(self.burst_s, self.level_s + self.share * max(0.0, now - self.at))

    def spend(self, stall_s: float, now: float) -> StallBudget:
        """The budget after a local turn that stalls the batch for `stall_s` seconds, sent at `now`."""
        return StallBudget(self.share, self.window_s, self.credit(now) - max(0.0, stall_s), max(now, self.at))

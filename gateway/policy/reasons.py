"""Why a turn went where it went, in a few words: the closed set of reason buckets a plan carries as its metric
label.

A plan's ``reason`` is free text with node URLs and numbers (right for a span or a log line, unbounded as a
label). So the rule that writes a reason also names its bucket (``Plan.bucket``), one of :data:`BUCKETS`
(docs/metrics.md lists which reasons fall in each):

- the pull rule (``rules/pull.py``, also ``auto`` without a verified prompt length): why it went cold, or that
  the guard verified the handle it pulls;
- ``no-pull`` and ``reference``: the rule itself decided (``policy_fixed``);
- ``auto`` (``rules/auto.py`` over ``costmodel.choose``): ``*_cheapest`` when the pull was possible (so the option
  won on cost, or the pull did); else what ruled the pull out, which is the question an operator asks of a cold or
  local turn. ``forced``: nothing was within the limits;
- the peer rules (``rules/peers.py``): how much the decode node's prefix cache lacks, or which load rule decided.

``other`` is a plan no rule named (one built by hand, a pool instance running a turn itself for want of another
instance): a label value never fails a turn.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Final

from kvtether.gateway.policy.registry import names, policy_named

FIRST_TURN: Final = "first_turn"  # a new session: nothing held yet
NO_HANDLE: Final = "no_handle"  # the session holds no usable handle: none stored, or it expired (or will first)
NODE_LOST: Final = "node_lost"  # the session's decode node is out: the turn was re-placed, its handle is gone
GUARD_REFUSED: Final = "guard_refused"  # the guard verified too little of the handle (or could not verify)
NO_BIDIRECTIONAL_PREFILL: Final = "no_bidirectional_prefill"  # no healthy prefill node may receive a handle
HANDLE_VERIFIED: Final = "handle_verified"  # the pull rule: the guard verified the handle, so it is pulled
POLICY_FIXED: Final = "policy_fixed"  # no-pull and reference: the rule decides, whatever the turn
PULL_CHEAPEST: Final = "pull_cheapest"  # auto: the pull scored lowest
LOCAL_CHEAPEST: Final = "local_cheapest"  # auto: the pull was possible, decode-local scored lower
COLD_CHEAPEST: Final = "cold_cheapest"  # auto: the pull was possible, a cold prefill scored lower
FORCED: Final = "forced"  # auto: no option within the limits; run over one rather than fail the turn
# auto: every option within the limits was past the TTFT objective, and one over a pool instance's TPOT quota within
# it ran (PolicyKnobs.ttft_over_quota).
TTFT_RESCUE: Final = "ttft_rescue"
# auto: the pull was over a limit that clears as what runs there finishes (a TPOT quota, a prefill still running
# where its answer would decode, a pool instance short of memory), and another option within its limits ran.
PULL_OVER_LIMIT: Final = "pull_over_limit"
# The peer rules (policy/peers.py): what the decode node's prefix cache lacks is short (prefill there) or long
# (disaggregate); Dynamo's load rule found the prefill node busy; its decode-busy veto cancelled a local prefill.
UNCACHED_SHORT: Final = "uncached_short"
UNCACHED_LONG: Final = "uncached_long"
PREFILL_BUSY: Final = "prefill_busy"
DECODE_BUSY: Final = "decode_busy"
OTHER: Final = "other"  # a plan no rule named

BUCKETS: Final = (FIRST_TURN, NO_HANDLE, NODE_LOST, GUARD_REFUSED, NO_BIDIRECTIONAL_PREFILL, HANDLE_VERIFIED,
                  POLICY_FIXED, PULL_CHEAPEST, LOCAL_CHEAPEST, COLD_CHEAPEST, FORCED, TTFT_RESCUE, PULL_OVER_LIMIT,
                  UNCACHED_SHORT, UNCACHED_LONG, PREFILL_BUSY, DECODE_BUSY, OTHER)


class _DeclaredSeries(Mapping[str, tuple[tuple[str, str], ...]]):
    """The (action, bucket) series each registered policy declares (``Policy.series``), by its name: a view of the
    registry, so a policy registered later is in it too."""

    def __getitem__(self, name: str) -> tuple[tuple[str, str], ...]:
        try:
            return policy_named(name).series
        except ValueError:
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(names())

    def __len__(self) -> int:
        return len(names())


SERIES: Final[Mapping[str, tuple[tuple[str, str], ...]]] = _DeclaredSeries()

"""The placement policies, by the name an operator configures: each one :class:`Policy` object that declares what it
does, so the rest of the gateway asks the policy (``config.placement_policy.keeps_handles``) instead of testing
its name.

The built-in policies are declared one a file in ``rules/`` and registered, in the order an error message lists
them, when the ``policy`` package is imported (``rules/__init__.py``). A new policy is one more file there: its
rule (pure: turn, cluster and inputs in, a :class:`~kvtether.gateway.policy.placement.Plan` with its reason and
metric bucket out) and its traits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    # Only for annotations: placement looks policies up here, so this module may not import it at run time.
    from kvtether.gateway.policy.placement import Rule


@dataclass(frozen=True, slots=True)
class Policy:
    """A placement policy: its rule, and what the gateway does around the rule's plans for it. The traits are
    read by the shell (gather, remember, the TPOT quotas, retention, metrics); the rule alone decides where a turn
    goes."""

    name: str
    plan: Rule
    # The guard verifies the session's held sequence against the prompt's tokens before its handle is reused.
    verifies_reuse: bool = False
    # The rule weighs what the session's decode node holds in its prefix cache (learned from D's token ids).
    reads_decode_cache: bool = False
    # On a pool, even a turn with nothing held (a first one, one gone cold) is tokenized: the rule weighs which
    # instance starts it, and how, by its length.
    sizes_pool_turns: bool = False
    # The session's handle is taken from the store for the rule to send to a prefill node.
    pulls: bool = False
    # The handle a P/D turn leaves on its decode node is stored for a later pull; otherwise it is released at once.
    keeps_handles: bool = False
    # Decode-local turns go out marked for retention (config.local_turn_handles), so D returns a handle to pull.
    marks_local_turns: bool = False
    # The retention review releases held handles when decode memory is wanted or they near expiry; off, they are
    # held until the engine's TTL (what vLLM's reference proxy does).
    releases_held_handles: bool = True
    # Decode-local turns and pool prefills are held to per-request TPOT quotas of stall (policy/stallquota.py).
    uses_stall_quotas: bool = False
    # The session remembers which other nodes' prefix caches still hold its history (policy/copies.py).
    tracks_cache_copies: bool = False
    # The (action, reason bucket) series of kvtether_placement_decisions_total the rule can produce, created at
    # zero at start-up so a rate() sees the first one (policy/reasons.py names the buckets).
    series: tuple[tuple[str, str], ...] = ()

    @property
    def tokenizes_prompts(self) -> bool:
        """Whether the prompt is tokenized when there is something held to compare it with (and D asked for its
        token ids): the guard's check or the decode cache's match needs them."""
        return self.verifies_reuse or self.reads_decode_cache


class Configured(Protocol):
    """Whatever names a policy: the gateway's configuration, a turn."""

    @property
    def policy(self) -> str: ...


_REGISTRY: dict[str, Policy] = {}


def register(policy: Policy) -> Policy:
    """Make `policy` configurable by its name; a name is registered once."""
    if policy.name in _REGISTRY:
        raise ValueError(f"placement policy {policy.name!r} is already registered")
    _REGISTRY[policy.name] = policy
    return policy


@contextmanager
def registered(policy: Policy) -> Iterator[Policy]:
    """`policy` registered for the block's length (a test's, or an experiment's, own policy)."""
    register(policy)
    try:
        yield policy
    finally:
        del _REGISTRY[policy.name]


def names() -> tuple[str, ...]:
    """Every registered policy's name, in the order they were registered."""
    return tuple(_REGISTRY)


def is_known(name: str) -> bool:
    return name in _REGISTRY


def policy_named(name: str) -> Policy:
    policy = _REGISTRY.get(name)
    if policy is None:
        raise ValueError(f"unknown placement policy {name!r}; known: {', '.join(_REGISTRY)}")
    return policy


def policy_of(configured: Configured) -> Policy:
    """The policy a configuration (or a turn) names."""
    return policy_named(configured.policy)

"""The built-in placement policies, one a file, registered by name in the order an error message lists them.

A new policy is a new file here (its rule and its :class:`~kvtether.gateway.policy.registry.Policy`) and its name
in ``BUILT_IN``; nothing outside ``gateway/policy/`` asks for a policy by name.
"""

from __future__ import annotations

from typing import Final

from kvtether.gateway.policy.registry import Policy, register
from kvtether.gateway.policy.rules.auto import AUTO
from kvtether.gateway.policy.rules.no_pull import NO_PULL
from kvtether.gateway.policy.rules.peers import DYNAMO_POLICY, LLM_D_POLICY
from kvtether.gateway.policy.rules.pull import PULL
from kvtether.gateway.policy.rules.reference import REFERENCE

BUILT_IN: Final[tuple[Policy, ...]] = (AUTO, PULL, NO_PULL, REFERENCE, DYNAMO_POLICY, LLM_D_POLICY)

for _policy in BUILT_IN:
    register(_policy)

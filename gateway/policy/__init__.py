"""The gateway's decisions (pure: no I/O, no clock read) and what they learn from finished turns.

- ``placement.plan``: facts about a turn, its session and the cluster in; a :class:`Plan` with its reason and its
  metric bucket out, by the turn's policy: a :class:`Policy` in ``registry``, one a file in ``rules/`` (the fixed
  ``pull``, ``no-pull``, ``reference``, the peers' ``dynamo`` and ``llm-d``, and ``auto``, which asks the cost
  model). A policy declares what it does (whether it pulls, keeps handles, uses TPOT quotas...): the rest of the
  gateway asks it, never its name.
- The cost model: ``costmodel.choose`` weighs decode-local, pull and cold per turn (``options`` estimates
  each, ``lookahead`` adds the next turn, ``facts`` and ``knobs`` are its inputs and parameters).
- What it reads of the cluster's speed: ``estimates`` (online node speeds), ``stallquota`` (per-request TPOT
  quotas), ``tail`` (where the TTFT tail starts), ``steps`` (engine step boundaries), ``copies`` (what other
  nodes' prefix caches still hold of a session); ``learning.Learning`` keeps them up to date from the turns
  the shell reports.
"""

# The built-in policies register themselves by name (rules/__init__.py): imported here, so any use of the package
# finds them.
from kvtether.gateway.policy import rules as rules
from kvtether.gateway.policy.costmodel import choose
from kvtether.gateway.policy.estimates import Estimator, EstimatorSeeds, EstimatorSnapshot, LearningParams
from kvtether.gateway.policy.facts import (
    OPTIONS,
    CostDecision,
    NodeLoad,
    NoFeasibleOption,
    Option,
    OptionEstimate,
    TurnFacts,
)
from kvtether.gateway.policy.knobs import TUNING_FIELDS, PolicyKnobs
from kvtether.gateway.policy.options import blocked_s
from kvtether.gateway.policy.placement import (
    ClusterView,
    HandleAction,
    HandleState,
    NoCapacity,
    Plan,
    Turn,
    least_loaded,
    plan,
    plan_aggregated,
)
from kvtether.gateway.policy.registry import Policy, policy_named, policy_of

__all__ = [
    "OPTIONS",
    "TUNING_FIELDS",
    "ClusterView",
    "CostDecision",
    "Estimator",
    "EstimatorSeeds",
    "EstimatorSnapshot",
    "HandleAction",
    "HandleState",
    "LearningParams",
    "NoCapacity",
    "NoFeasibleOption",
    "NodeLoad",
    "Option",
    "OptionEstimate",
    "Plan",
    "Policy",
    "PolicyKnobs",
    "Turn",
    "TurnFacts",
    "blocked_s",
    "choose",
    "least_loaded",
    "plan",
    "plan_aggregated",
    "policy_named",
    "policy_of",
]

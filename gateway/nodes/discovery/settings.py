"""Where the gateway finds its nodes: the ``[gateway.discovery]`` table, its defaults, and its one loader.

``source`` picks the backend: ``static`` (the ``prefill``/``decode``/``nodes``/``aggregated`` lists of the
gateway's settings, as before), ``dns`` (one name per role, re-resolved every ``dns_interval_s``: A/AAAA records
of ``HOST:PORT``, or SRV records of a name starting with ``_``, which carry the port) or ``kubernetes`` (the pods
of ``namespace`` matching ``selector``, their role from ``role_label``). Every setting is documented in
docs/configuration.md ("Node discovery"); the gateway's config.py only hands the table to :func:`load_discovery`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

SOURCES = ("static", "dns", "kubernetes")
# The labels a pod's role is read from, in order: kvtether's own, then llm-d's (prefill | decode | prefill-decode).
DEFAULT_ROLE_LABELS = ("kvtether.io/role", "llm-d.ai/role")


class DiscoveryError(ValueError):
    """A discovery setting that cannot work; the message names it (config.py re-raises it as a ConfigError)."""


@dataclass(frozen=True, slots=True)
class DiscoverySettings:
    source: str = "static"
    # dns: the names of each role's headless Service: "HOST:PORT" (A and AAAA records, this port) or an SRV name
    # "_SERVICE._PROTO.HOST" (its records name target and port). A node gone from the answer drains.
    dns_prefill: list[str] = field(default_factory=list)
    dns_decode: list[str] = field(default_factory=list)
    dns_pool: list[str] = field(default_factory=list)
    dns_interval_s: float = 5.0
    # kubernetes: the pods of `namespace` (None: the gateway pod's own, else the kubeconfig context's) that match
    # `selector` (a label selector: key=value, key!=value, key, !key, key in (a,b), comma-separated), each reached
    # at http://POD_IP:`port`, or at its container port named `port_name` when it has one.
    namespace: str | None = None
    selector: str = "app.kubernetes.io/part-of=kvtether"
    role_labels: list[str] = field(default_factory=lambda: list(DEFAULT_ROLE_LABELS))
    port: int = 8000
    port_name: str = "http"
    # A kubeconfig file; None: in a pod, its service account (token re-read as the kubelet rotates it), outside,
    # $KUBECONFIG or ~/.kube/config.
    kubeconfig: str | None = None
    # The API server ends each watch after this long (the gateway resumes it from the last resourceVersion).
    watch_timeout_s: float = 300.0
    # After a failed list or watch, the first wait before the next try; it doubles up to retry_max_s.
    retry_s: float = 0.5
    retry_max_s: float = 10.0
    scheme: str = "http"

    @property
    def dynamic(self) -> bool:
        """Nodes come and go (dns, kubernetes): the static lists may be empty."""
        return self.source != "static"

    def validate(self) -> DiscoverySettings:
        return _validate(self)


_LISTS = {"dns_prefill", "dns_decode", "dns_pool", "role_labels"}
_OPTIONAL: dict[str, type] = {"namespace": str, "kubeconfig": str}
_SELECTOR_TERM = re.compile(
    r"\s*(!?)([A-Za-z0-9./_-]+)\s*(?:(==|=|!=)\s*([A-Za-z0-9._-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*")


def load_discovery(table: Mapping[str, Any] | DiscoverySettings | None,
                   base: DiscoverySettings | None = None) -> DiscoverySettings:
    """The discovery settings: `base` (the defaults, or what a file set) with `table`'s keys over it (a TOML table,
    or the CLI's flags); validated. Dashes in keys are allowed."""
    start = base or DiscoverySettings()
    if table is None:
        return start.validate()
    if isinstance(table, DiscoverySettings):
        return table.validate()
    if not isinstance(table, Mapping):
        raise DiscoveryError("discovery must be a table ([gateway.discovery])")
    known = {f.name: f for f in fields(DiscoverySettings)}
    values: dict[str, Any] = {}
    for key, value in table.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise DiscoveryError(f"discovery: unknown setting {key!r}; known: {', '.join(sorted(known))}")
        if value is None:
            continue
        if name in _LISTS:
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
                raise DiscoveryError(f"discovery.{name} must be a list of strings")
            value = list(value)
        else:
            default = getattr(start, name) if getattr(start, name) is not None else _OPTIONAL[name]()
            if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if type(value) is not type(default):
                raise DiscoveryError(f"discovery.{name} must be {type(default).__name__}, got {value!r}")
        values[name] = value
    return replace(start, **values).validate()


def _validate(s: DiscoverySettings) -> DiscoverySettings:
    if s.source not in SOURCES:
        raise DiscoveryError(f"discovery.source must be one of {', '.join(SOURCES)}; got {s.source!r}")
    if s.source == "dns":
        if not (s.dns_prefill or s.dns_decode or s.dns_pool):
            raise DiscoveryError("discovery source dns needs names: dns_prefill and dns_decode, or dns_pool "
                                 "(--dns-prefill NAME --dns-decode NAME, or --dns-pool NAME)")
        for name in (*s.dns_prefill, *s.dns_decode, *s.dns_pool):
            parse_dns_name(name, s.port)
    if s.source == "kubernetes":
        parse_selector(s.selector)
        if not s.role_labels:
            raise DiscoveryError("discovery.role_labels must name at least one label")
    if not 0 < s.port < 65536:
        raise DiscoveryError(f"discovery.port {s.port} out of range")
    if s.scheme not in ("http", "https"):
        raise DiscoveryError("discovery.scheme must be http or https")
    for name in ("dns_interval_s", "watch_timeout_s", "retry_s"):
        if getattr(s, name) <= 0:
            raise DiscoveryError(f"discovery.{name} must be > 0")
    if s.retry_max_s < s.retry_s:
        raise DiscoveryError("discovery.retry_max_s must be >= retry_s")
    return s


def parse_dns_name(name: str, default_port: int) -> tuple[str, int | None]:
    """(the name to resolve, the port; None for an SRV name, whose records carry the port)."""
    name = name.strip()
    if not name:
        raise DiscoveryError("discovery: an empty DNS name")
    if name.startswith("_"):
        return name, None
    host, sep, port = name.rpartition(":")
    if not sep or "]" in port:
        return name.strip("[]"), default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise DiscoveryError(f"discovery: {name!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def parse_selector(selector: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """A label selector as (key, operator, values) terms; operator is one of =, !=, exists, !exists, in, notin."""
    terms: list[tuple[str, str, tuple[str, ...]]] = []
    for part in _split_selector(selector):
        m = _SELECTOR_TERM.fullmatch(part)
        if m is None or not part.strip():
            raise DiscoveryError(f"discovery.selector: cannot read {part.strip()!r} (use key=value, key!=value, "
                                 "key, !key, key in (a,b), key notin (a,b))")
        neg, key, op, value, set_op, values = m.groups()
        if neg and (op or set_op):
            raise DiscoveryError(f"discovery.selector: {part.strip()!r}: '!' only before a bare key")
        if set_op:
            terms.append((key, set_op, tuple(v.strip() for v in values.split(",") if v.strip())))
        elif op:
            terms.append((key, "!=" if op == "!=" else "=", (value,)))
        else:
            terms.append((key, "!exists" if neg else "exists", ()))
    return terms


def _split_selector(selector: str) -> list[str]:
    """Split at the commas outside parentheses."""
    parts, depth, current = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if current.strip() or parts:
        parts.append(current)
    return [p for p in parts if p.strip()] if selector.strip() else []

"""Who is calling: API keys bound to tenants, the admin key, and what the gateway tells vLLM.

With API keys configured every request must carry one (``Authorization: Bearer <key>``, or ``x-api-key``); its tenant
namespaces the caller's sessions (``scoped``), so one tenant can never name — and so never reuse the pin,
handle or held KV of — another tenant's session, whatever session id it sends. Keys are compared by their
SHA-256 digest, so the lookup's timing says nothing about a key's characters.

The engines' prefix caches are kept apart the same way (``cache_salt``): vLLM salts a request's block hashes
with it, so a request only hits blocks cached by requests of the same salt. A tenant's salt is an HMAC keyed
by a digest of that tenant's own API keys: every replica derives the same one without configuration, no other
tenant can compute it, and a salt a client sends only divides its own tenant's cache further.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from kvtether.gateway.config import GatewayConfig
from kvtether.gateway.errors import GatewayError


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def bearer(headers: Mapping[str, str]) -> str | None:
    """The caller's key: ``Authorization: Bearer <key>``, or ``x-api-key`` (how Anthropic clients send it)."""
    value = headers.get("authorization") or ""
    scheme, _, token = value.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return (headers.get("x-api-key") or "").strip() or None


class Auth:
    def __init__(self, config: GatewayConfig) -> None:
        self._tenants = {_digest(k): t for k, t in config.api_keys.items()}
        self._salt_keys: dict[str, bytes] = {}
        if config.tenant_cache_salt:
            for tenant in set(self._tenants.values()):
                own = sorted(d for d, t in self._tenants.items() if t == tenant)
                self._salt_keys[tenant] = hashlib.sha256(b"kvtether-cache-salt\0" + b"".join(own)).digest()
        self._admin = _digest(config.admin_key) if config.admin_key else None
        self._upstream = config.upstream_api_key

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    def tenant(self, headers: Mapping[str, str]) -> str | None:
        """The caller's tenant (None: no API keys configured); 401 without a valid key."""
        if not self._tenants:
            return None
        key = bearer(headers)
        tenant = self._tenants.get(_digest(key)) if key else None
        if tenant is None:
            raise GatewayError(401, "a valid API key is required (Authorization: Bearer <key>)",
                               code="invalid_api_key")
        return tenant

    def check_admin(self, headers: Mapping[str, str]) -> None:
        """/admin/* needs the admin key when one is set; without one it is open only when no API keys are."""
        if self._admin is None:
            if self._tenants:
                raise GatewayError(403, "the admin API is off: set admin_key to use it", code="admin_disabled")
            return
        key = bearer(headers)
        if key is None or not hmac.compare_digest(_digest(key), self._admin):
            raise GatewayError(401, "the admin key is required (Authorization: Bearer <admin key>)",
                               code="invalid_admin_key")

    def cache_salt(self, tenant: str | None, requested: str | None) -> str | None:
        """The `cache_salt` every leg of the caller's request carries: the tenant's, with the client's own salt
        folded in (None: no tenants, or tenant salts off; the client's salt then goes through as it is)."""
        key = self._salt_keys.get(tenant) if tenant is not None else None
        if key is None:
            return requested
        mixed = hmac.new(key, b"" if requested is None else b"\1" + requested.encode(), hashlib.sha256)
        return mixed.hexdigest()

    def upstream_authorization(self, headers: Mapping[str, str]) -> str | None:
        """The Authorization header the legs send vLLM: the configured upstream key, else the client's own
        unless it was the client's gateway API key (never forwarded)."""
        if self._upstream:
            return f"Bearer {self._upstream}"
        if self._tenants:
            return None
        if headers.get("authorization"):
            return headers["authorization"]
        key = (headers.get("x-api-key") or "").strip()
        return f"Bearer {key}" if key else None


def scoped(tenant: str | None, key: str) -> str:
    """A session id or message-chain key in the caller's namespace (tenant names hold no "/")."""
    return key if tenant is None else f"{tenant}/{key}"

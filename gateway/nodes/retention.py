"""Decode memory: releasing the handles the gateway will not pull, and counting what the rest hold.

A release is vLLM's own consume path used on purpose (docs/operations.md, "Decode memory"): a one-token
completion on a bidirectional prefill node carrying the handle makes P compute that token locally (below
``kv_recompute_threshold``) and notify D, which frees the hold at once. P answers with prefill params (dropped
here) and keeps one block under its own 30 s lease. A release never carries the client's request: it goes out
off the request path, from a bounded queue served by a few workers.

Two ways in: the request path calls :meth:`Retention.release` when it knows a handle is done for (superseded,
refused by the guard, left unused, the session's last); :meth:`Retention.review_forever` reads every live
session of the store (page by page: a shared store may hold far more than one listing shows) every
``retention_interval_s``, refreshes the held-KV gauges, and releases what the pure policy
(``policy/retention.py``) says: handles at their expiry, and where a decode node's memory is wanted (held KV
over its budget, or its requests waiting or preempted with its KV nearly full, as its last poll said) the least
likely to be pulled. Each is taken from the store first (conditionally: only while it is still the handle the
review saw), so with replicas sharing a store exactly one of them releases it, and a turn that took it first
simply has it. A review the store could not answer to the end decides nothing: a partial view would count too
little held KV.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from kvtether.gateway import telemetry as T
from kvtether.gateway.clock import DEFAULT_CLOCK, Clock
from kvtether.gateway.config import GatewayConfig
from kvtether.gateway.guard.verify import handle_num_tokens, handle_request_id
from kvtether.gateway.nodes.cluster import Cluster, Node
from kvtether.gateway.policy.retention import (
    DecodeMemory,
    HeldHandle,
    HeldLedger,
    Release,
    ReleaseReason,
    RetentionKnobs,
    review,
)
from kvtether.gateway.stores.failsafe import StoreUnavailable
from kvtether.gateway.stores.sessions import SCAN_PAGE_SIZE, SessionState, SessionStore

log = logging.getLogger(__name__)

QUEUE_SIZE = 1024  # releases waiting for a worker; past it one is dropped (counted) and the TTL frees its hold
RELEASE_TIMEOUT_S = 10.0  # a one-token prefill; a node this slow is in trouble, and the TTL is the fallback
SHUTDOWN_GRACE_S = 5.0  # how long shutdown waits for its releases to go out
RELEASE_TOKEN = 0  # the one prompt token a release computes: any id works, P never reads D's blocks for it


@dataclass(frozen=True, slots=True)
class _Job:
    handle: dict[str, Any]
    node: str  # the decode node that holds it
    reason: ReleaseReason


def retention_knobs(config: GatewayConfig) -> RetentionKnobs:
    # Two review intervals before its expiry: the first review in that window releases a handle while the store
    # still holds its session (it forgets the session at its expiry, no later than the handle's).
    return RetentionKnobs(budget_share=config.held_kv_budget if config.held_kv_budget < 1.0 else None,
                          low_water=config.release_low_water, pressure_usage=config.decode_pressure_usage,
                          expiry_lead_s=2 * config.retention_interval_s)


@dataclass(frozen=True, slots=True)
class _DecodeView:
    """What the review knows of each decode node: its memory (size, block size, the last poll's usage, and
    waiting requests and preemptions from a poll no review has acted on), and whether its prefix cache shares
    blocks between requests (vllm:cache_config_info; unknown until a poll said: counted as not)."""

    memory: dict[str, DecodeMemory]
    sharing: dict[str, bool]

    @property
    def sizes(self) -> dict[str, int]:
        return {url: m.block_size for url, m in self.memory.items()}


class Retention:
    def __init__(self, config: GatewayConfig, cluster: Cluster, store: SessionStore, metrics: T.Metrics,
                 client: httpx.AsyncClient, clock: Clock = DEFAULT_CLOCK,
                 scan_page: int = SCAN_PAGE_SIZE) -> None:
        self.config, self.cluster, self.store, self.metrics, self.client, self.clock = (
            config, cluster, store, metrics, client, clock)
        self.scan_page = scan_page  # sessions per page of the review's read of the store
        # A policy may hold everything until the engine's TTL (the reference policy, as vLLM's reference proxy).
        self.enabled = (config.release_handles and config.mode == "pd"
                        and config.placement_policy.releases_held_handles)
        self.knobs = retention_knobs(config)
        if config.idle_release_s is not None and config.mode == "pd":
            log.warning("idle_release_s is deprecated and ignored: a handle is released when its decode node's "
                        "memory is wanted (held_kv_budget, decode_pressure_usage) or at its expiry (session_ttl_s), "
                        "not on a timer")
        send, receive = anyio.create_memory_object_stream[_Job](QUEUE_SIZE)
        self._send: MemoryObjectSendStream[_Job] = send
        self._receive: MemoryObjectReceiveStream[_Job] = receive
        self._pending = 0  # queued or in flight
        self._idle = anyio.Event()
        self._idle.set()
        self._rr = 0
        # Per decode node, what the last review read of its last poll: the poll's count, the preemption counter,
        # and how many polls in a row had shown requests waiting for capacity with none running. A poll's
        # waiting requests and preemptions ask for releases once.
        self._seen: dict[str, tuple[int, float, int]] = {}
        self._ledger = HeldLedger()  # the held handles' blocks as of the last review, counted once each

    # ---- the request path's releases ---------------------------------------------------------------

    def release(self, handle: dict[str, Any] | None, node: str | None, reason: ReleaseReason) -> None:
        """Queue the release of a handle the gateway no longer holds (it is out of the store). Never blocks."""
        if not self.enabled or handle is None or node is None:
            return
        try:
            self._send.send_nowait(_Job(handle, node, reason))
        except anyio.WouldBlock:
            self.metrics.release_failures.labels("queue_full").inc()
            return
        self._queued()

    async def release_session(self, session_id: str, reason: ReleaseReason) -> bool:
        """Take a session's handle out of the store and release it; False when it had none."""
        state = await self.store.get(session_id)
        taken = await self.store.take_handle(session_id)
        if taken is None:
            return False
        self.release(taken.handle, state.decode if state is not None else None, reason)
        return True

    def _queued(self) -> None:
        self._pending += 1
        if self._idle.is_set():
            self._idle = anyio.Event()

    def _done(self) -> None:
        self._pending -= 1
        if self._pending == 0:
            self._idle.set()

    # ---- the background side -----------------------------------------------------------------------

    async def run(self) -> None:
        """Release workers and the periodic review, until cancelled (the app's lifespan)."""
        if self.config.mode != "pd":
            return
        async with anyio.create_task_group() as tg:
            if self.enabled:
                for _ in range(self.config.release_concurrency):
                    tg.start_soon(self._worker, self._receive.clone())
            tg.start_soon(self.review_forever)

    async def _worker(self, jobs: MemoryObjectReceiveStream[_Job]) -> None:
        async with jobs:
            async for job in jobs:
                try:
                    await self._send_release(job)
                except Exception:  # a release is best effort: the engine's TTL frees the hold anyway
                    log.exception("handle release failed")
                    self.metrics.release_failures.labels("upstream").inc()
                finally:
                    self._done()

    async def _send_release(self, job: _Job) -> None:
        # Any bidirectional P but the holder itself (a pool instance is both): the release is a read from it.
        prefills = [n for n in self.cluster.role("prefill")
                    if n.routable and n.url != job.node and n.bidirectional]
        models = self.cluster.served_models() or ([self.config.model] if self.config.model else [])
        if not prefills or not models:
            self.metrics.release_failures.labels("no_prefill").inc()
            return
        body = {"model": models[0], "prompt": [RELEASE_TOKEN], "max_tokens": 1, "stream": False,
                "kv_transfer_params": job.handle}
        headers = {"authorization": f"Bearer {self.config.upstream_api_key}"} if self.config.upstream_api_key else {}
        # One more try on another prefill node after a connection failure or a 5xx; a 4xx is the request's fault.
        for attempt in range(min(2, len(prefills))):
            self._rr += 1
            node = prefills[(self._rr + attempt) % len(prefills)]
            try:
                resp = await self.client.post(f"{node.url}/v1/completions", json=body, headers=headers,
                                              timeout=RELEASE_TIMEOUT_S)
            except httpx.HTTPError as exc:
                log.info("release of a handle on %s via %s failed: %s", job.node, node.url, exc)
                continue
            if resp.status_code == 200:
                self.metrics.handle_releases.labels(job.reason.value).inc()
                log.debug("released a handle of %s tokens on %s (%s)", handle_num_tokens(job.handle), job.node,
                          job.reason.value)
                return
            log.info("release of a handle on %s via %s: HTTP %s %s", job.node, node.url, resp.status_code,
                     resp.text[:200])
            if resp.status_code < 500:
                break
        self.metrics.release_failures.labels("upstream").inc()

    async def review_forever(self) -> None:
        while True:
            try:
                await self.review_once()
            except Exception:  # a failed review must not stop the next one
                log.exception("retention review failed")
            await anyio.sleep(self.config.retention_interval_s)

    async def review_once(self) -> list[Release]:
        """Refresh the held-KV view and gauges; release what the policy says (when releasing is on)."""
        now = self.clock()
        decodes = self.cluster.role("decode")
        view = _DecodeView(memory={n.url: self._memory(n) for n in decodes},
                           sharing={n.url: n.prefix_caching is True for n in decodes})
        try:
            handles = await self._handles(view)
        except StoreUnavailable:
            log.info("retention review skipped: the session store did not answer to the end")
            return []
        for n in decodes:
            if self._seen.get(n.url, (0,))[0] != n.polls:  # a poll read now: its facts are spent
                self._seen[n.url] = (n.polls, n.preemptions, view.memory[n.url].blocked_polls)
        self._ledger.sync(handles, view.sizes)
        releases = review(handles, view.memory, now, self.knobs, self._ledger) if self.enabled else []
        gone: set[str] = set()
        for r in releases:
            taken = await self.store.take_handle(r.session_id, r.request_id)
            if taken is not None:
                self.release(taken.handle, r.node, r.reason)
                gone.add(r.session_id)
        if gone:
            self._ledger.sync((h for h in handles if h.session_id not in gone), view.sizes)
        held = self._ledger.held_by_node()
        for n in decodes:
            n.held_kv_tokens = held.get(n.url, 0)
            self.metrics.held_kv_tokens.labels(n.url).set(n.held_kv_tokens)
            if n.kv_capacity_tokens:
                self.metrics.held_kv_share.labels(n.url).set(n.held_kv_tokens / n.kv_capacity_tokens)
        return releases

    def _memory(self, n: Node) -> DecodeMemory:
        """Node ``n``'s memory as the policy sees it: waiting requests and preemptions only from a poll no review
        has read yet, so that the releases a poll asked for are not asked for again before a poll shows them."""
        polls, preemptions, blocked = self._seen.get(n.url, (0, n.preemptions, 0))
        if n.polls == polls:
            return DecodeMemory(capacity=n.kv_capacity_tokens, block_size=self.cluster.block_size(n.url),
                                usage=n.kv_usage)
        waiting = n.waiting_capacity if n.waiting_capacity is not None else n.waiting
        blocked_now = n.waiting_capacity is not None and n.waiting_capacity > 0 and n.running == 0
        return DecodeMemory(capacity=n.kv_capacity_tokens, block_size=self.cluster.block_size(n.url),
                            usage=n.kv_usage, waiting=waiting, preempted=max(0.0, n.preemptions - preemptions),
                            blocked_polls=blocked + 1 if blocked_now else 0)

    async def _handles(self, view: _DecodeView) -> list[HeldHandle]:
        """Every handle of every live session, read page by page (only what the policy needs is kept)."""
        out: list[HeldHandle] = []
        async for page in self.store.scan(self.scan_page):
            out.extend(h for s in page if (h := self._held(s, view)) is not None)
        return out

    def _held(self, s: SessionState, view: _DecodeView) -> HeldHandle | None:
        if s.handle is None or s.decode is None:
            return None
        at = s.handle_at if s.handle_at is not None else self.clock()
        # Its blocks by hash only where they can be shared: D's prefix cache on, and hashes made for the block
        # size D uses now (a turn before the first poll hashed with the default).
        shareable = (s.held is not None and view.sharing.get(s.decode, False)
                     and s.held.block_size == view.sizes.get(s.decode))
        return HeldHandle(session_id=s.session_id, node=s.decode, tokens=handle_num_tokens(s.handle) or 0,
                          request_id=handle_request_id(s.handle), stored_at=at,
                          expires_at=at + self.config.session_ttl_s,
                          last_turn_at=s.last_turn_at if s.last_turn_at is not None else at,
                          mean_gap_s=s.mean_gap_s,
                          blocks=s.held.hashes if shareable and s.held is not None else None,
                          scope=s.cache_scope or "")

    async def shutdown(self) -> None:
        """At gateway shutdown: with a store of its own (memory), nothing will pull its handles again, so they
        are released; a shared store's handles stay for the other replicas. Waits for queued releases, bounded."""
        with anyio.move_on_after(SHUTDOWN_GRACE_S):
            if self.enabled and self.config.store == "memory":
                for s in await self.store.list():
                    if s.handle is None:
                        continue
                    taken = await self.store.take_handle(s.session_id)
                    if taken is not None:
                        await self._send.send(_Job(taken.handle, s.decode or "", ReleaseReason.SHUTDOWN))
                        self._queued()
            await self._idle.wait()


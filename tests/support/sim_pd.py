"""Two simulated nodes driven as vLLM's reference proxy drives vLLM: one P/D turn by hand (P leg, then D leg with
P's params), and the counters and message helpers the simulator's protocol tests share."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import httpx

P_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
async def p2p_tokens(h: httpx.AsyncClient, url: str) -> float:
    """A node's `vllm:prompt_tokens_cached_by_source_total{source="p2p"}`: prompt tokens it read over NIXL."""
    text = (await h.get(url + "/metrics")).text
    return sum(
        float(ln.rsplit(" ", 1)[1])
        for ln in text.splitlines()
        if ln.startswith("vllm:prompt_tokens_cached_by_source_total{") and 'source="p2p"' in ln
    )


def rewrite(params: dict[str, Any], url: str) -> dict[str, Any]:
    """What a proxy does: point remote_host at the host it reached that node at."""
    return {**params, "remote_host": urlsplit(url).hostname}


async def pd_turn(
    h: httpx.AsyncClient,
    p_url: str,
    d_url: str,
    body: dict[str, Any],
    handle: dict[str, Any] | None = None,
    *,
    rewrite_hosts: bool = False,
) -> tuple[httpx.Response, httpx.Response | None]:
    """One turn: P leg (with a handle, if any) then D leg, like disagg_proxy_multiturn.py."""
    p_body = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    kvp = dict(handle) if handle is not None else dict(P_PARAMS)
    if handle is not None and rewrite_hosts:
        kvp = rewrite(kvp, d_url)
    p_body.update(max_tokens=1, stream=False, kv_transfer_params=kvp)
    if "max_completion_tokens" in body:
        p_body["max_completion_tokens"] = 1
    p = await h.post(p_url + "/v1/chat/completions", json=p_body)
    if p.status_code != 200:
        return p, None
    p_params = p.json()["kv_transfer_params"]
    if rewrite_hosts:
        p_params = rewrite(p_params, p_url)
    d = await h.post(d_url + "/v1/chat/completions", json={**body, "kv_transfer_params": p_params})
    return p, d


def chat(messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return {"model": "kvtether-sim", "messages": messages, "temperature": 0, **kw}


def reply(d: httpx.Response) -> dict[str, Any]:
    msg = d.json()["choices"][0]["message"]
    return {"role": "assistant", "content": msg["content"]}

"""Hostile clients against the gateway: prints tried / 2xx / 4xx / 5xx / resets / hangs, then whether the gateway
is still healthy and still answers a valid turn correctly.

The gateway runs in front of a simulated 1P 1D cluster (in this process). Requests are generated from a seed:
valid bodies with fields replaced by arbitrary JSON, messages, content parts and tools of arbitrary shape,
malformed bytes (truncated or invalid JSON, invalid UTF-8, random bytes), JSON nested thousands deep, hundreds
of thousands of messages, prompts
far beyond the model's context, bodies over the size limit, odd session headers, wrong content types, methods
and paths. They go out `--concurrency` at a time; a request unanswered after `--timeout-s` is a hang.

    .venv/bin/python benchmarks/fuzz_gateway.py [--requests 600] [--seed 0] [--concurrency 8]

Exit code 0 when there was no 5xx, reset or hang and the gateway is healthy after; 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import string
import sys
import time
from typing import Any

import httpx
from kvtether.cli.simstack import StackSpec, sim_stack

MODEL = "kvtether-sim"
FIELDS = ["model", "messages", "stream", "max_tokens", "max_completion_tokens", "min_tokens", "temperature", "top_p",
          "top_k", "n", "tools", "tool_choice", "stop", "seed", "logprobs", "top_logprobs", "return_token_ids",
          "stream_options", "response_format", "chat_template_kwargs", "presence_penalty", "kv_transfer_params",
          "prompt", "ignore_eos"]
ROLES = ["system", "user", "assistant", "tool", "developer", "function", "wizard", "", None, 3]


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 7, 2**31, 2**64, -(2**70), 10**30])
    if kind == 3:
        return rng.choice([0.0, -0.5, 1e-9, 3.7, 1e300, -1e308])
    if kind in (4, 5):
        return "".join(rng.choice(string.printable) for _ in range(rng.randrange(0, 40)))
    if kind == 6:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    if kind == 7:
        return {_text(rng, 6): _value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}
    return {"type": rng.choice(["text", "image_url", "function", "x"]), "text": _value(rng, depth + 1)}


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_letters + string.digits + "_-") for _ in range(rng.randrange(0, n)))


def _message(rng: random.Random) -> Any:
    if rng.random() < 0.1:
        return _value(rng)
    m: dict[str, Any] = {"role": rng.choice(ROLES)}
    if rng.random() < 0.8:
        m["content"] = rng.choice([_text(rng, 40), _value(rng), [_value(rng), _value(rng)]])
    if rng.random() < 0.2:
        m["tool_calls"] = _value(rng)
    if rng.random() < 0.1:
        m["tool_call_id"] = _value(rng)
    return m


def _nested(levels: int) -> bytes:
    return b'{"model": "' + MODEL.encode() + b'", "messages": ' + b"[" * levels + b"]" * levels + b"}"


def hostile(rng: random.Random, max_body: int) -> tuple[str, str, bytes, dict[str, str]]:
    """(method, path, body bytes, headers) of one hostile request."""
    chat = rng.random() < 0.7
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    base.update({"messages": [{"role": "user", "content": "hello"}]} if chat else {"prompt": "Once upon"})
    headers = {"content-type": "application/json"}
    kind = rng.randrange(12)
    if kind <= 4:  # a valid body, mutated
        for name in rng.sample(FIELDS, rng.randrange(1, 4)):
            if name == "messages":
                base[name] = [_message(rng) for _ in range(rng.randrange(0, 4))]
            elif rng.random() < 0.2:
                base.pop(name, None)
            else:
                base[name] = _value(rng)
        body = json.dumps(base).encode()
    elif kind == 5:  # malformed bytes
        valid = json.dumps(base).encode()
        body = rng.choice([valid[: rng.randrange(len(valid))], b"\xff\xfe" + valid, bytes(rng.randrange(256)
                           for _ in range(rng.randrange(1, 200))), b"", b"null", b"[1,2]", b'"x"', b"{'a': 1}"])
    elif kind == 6:  # nested far deeper than any real request, or far more messages than a real history
        if rng.random() < 0.7:
            body = _nested(rng.choice([40, 1000, 5000, 100_000]))
        else:
            base["messages"] = [{"role": "user", "content": "x"}] * rng.choice([10_001, 300_000])
            body = json.dumps(base).encode()
    elif kind == 7:  # a prompt far beyond the context, under the body limit
        filler = "word " * rng.choice([300_000, 1_000_000, (max_body - 1000) // 5])
        base.update({"messages": [{"role": "user", "content": filler}]} if chat else {"prompt": filler})
        body = json.dumps(base).encode()
    elif kind == 8:  # over the body limit
        body = b'{"model": "x", "prompt": "' + b"a" * (max_body + 10) + b'"}'
    elif kind == 9:  # odd headers on a valid body
        name = rng.choice(["x-session-id", "x-dynamo-session-id", "x-kvtether-turn", "x-kvtether-prefix",
                           "x-kvtether-prefix-parent", "authorization"])
        headers[name] = rng.choice(["", "a b", "x" * 1000, "../../etc", "-1", "%C3%BC", "<x>;y", "0" * 17])
        body = json.dumps(base).encode()
    elif kind == 10:  # wrong content type or a streamed body that is not JSON
        headers["content-type"] = rng.choice(["text/plain", "multipart/form-data", "application/x-www-form-urlencoded"])
        body = rng.choice([json.dumps(base).encode(), b"model=x&messages=y"])
    else:  # wrong method or path
        return (rng.choice(["GET", "PUT", "DELETE", "PATCH"]), rng.choice([path, "/v1/x", "/admin/sessions/../x",
                "/%00", "/v1/models/../../"]), b"", {})
    return "POST", path, body, headers


async def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    spec = StackSpec(preset="toy", prefill=1, decode=1, speed=50.0, prefill_prefix_caching=True,
                     cluster={"kv_recompute_threshold": 4})
    counts: collections.Counter[str] = collections.Counter()
    examples: dict[str, list[str]] = collections.defaultdict(list)
    async with sim_stack(spec, "auto", gateway={"metrics_poll_interval_s": 1.0}) as stack:
        url, cfg = stack.url, stack.config
        async with httpx.AsyncClient(timeout=args.timeout_s) as client:
            todo = [hostile(rng, cfg.max_body_bytes) for _ in range(args.requests)]
            sem = asyncio.Semaphore(args.concurrency)

            async def send(req: tuple[str, str, bytes, dict[str, str]]) -> None:
                method, path, body, headers = req
                async with sem:
                    try:
                        resp = await client.request(method, url + path, content=body, headers=headers)
                        text = resp.text
                        cls = f"{resp.status_code // 100}xx"
                        if resp.status_code < 400 and "upstream_error" in text:
                            cls = "5xx"  # a stream that broke after it started
                    except httpx.TimeoutException:
                        cls, text = "hangs", ""
                    except httpx.TransportError as exc:
                        cls, text = "resets", repr(exc)
                    counts[cls] += 1
                    if cls in ("5xx", "hangs", "resets") and len(examples[cls]) < 3:
                        examples[cls].append(f"{method} {path} {body[:120]!r} -> {text[:200]}")

            started = time.perf_counter()
            await asyncio.gather(*(send(r) for r in todo))
            took = time.perf_counter() - started
            ready = (await client.get(f"{url}/ready")).json()
            valid = await client.post(f"{url}/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "are you still there?"}], "max_tokens": 8})
    bad = counts["5xx"] + counts["resets"] + counts["hangs"]
    print(f"tried {args.requests} hostile requests in {took:.1f} s (seed {args.seed}, {args.concurrency} at a time)")
    print(" | ".join(f"{k} {counts[k]}" for k in ("2xx", "4xx", "5xx", "resets", "hangs")))
    for cls, lines in examples.items():
        for line in lines:
            print(f"  {cls}: {line}")
    healthy = ready.get("ready") is True and valid.status_code == 200
    print(f"gateway after: ready={ready.get('ready')}, nodes healthy="
          f"{all(n['healthy'] for n in ready.get('nodes', []))}, a valid turn -> HTTP {valid.status_code}")
    return 0 if bad == 0 and healthy else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--timeout-s", type=float, default=30.0)
    sys.exit(asyncio.run(run(ap.parse_args())))


if __name__ == "__main__":
    main()

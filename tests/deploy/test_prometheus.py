"""The operator's kit in deploy/ against a real Prometheus.

promtool checks the alert rules, runs their unit tests (deploy/prometheus/kvtether-alerts.test.yml: each alert
fires on its series) and checks the example scrape configuration. Then a simulated cluster and a gateway (with a
Redis session store, so the store's latency has data) serve a few agent sessions while a real Prometheus scrapes
them every second with the rules loaded: every query of every dashboard panel must return data through
Prometheus's HTTP API (those the traffic moves, more than zeros), every rule must be loaded and evaluate without
error, and the node alerts must be pending for a prefill node that is configured but down, and no other alert for
the healthy rest.

``scripts/test`` installs Debian's prometheus package first (scripts/ensure-prometheus.sh); without the
binaries these tests are skipped with that reason.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx
import pytest
import yaml
from kvtether.gateway import telemetry as T
from kvtether.gateway.config import load_config
from kvtether.gateway.shell.app import create_app
from kvtether.gateway.shell.server import serve_gateway
from kvtether.protocol.contract import FINAL_HEADER
from kvtether.sim.cluster import ClusterSpec, SimCluster

from tests.support.gateway_agent import chat, first_messages, next_messages, request_body
from tests.support.redis_server import free_port, running_redis, server_binary
from tests.support.sim_rig import LIMITS, SPEED

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "kvtether-alerts.yml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "kvtether-alerts.test.yml"
EXAMPLE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvtether-dashboard.json"

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="no prometheus/promtool on PATH (scripts/ensure-prometheus.sh installs Debian's; scripts/test runs it)")

# Scrape and rule evaluation every second: the run lasts seconds, not the minutes a deployment looks at.
SCRAPE_S = 1
# What Grafana puts in the panels' variables for a data source whose scrape interval is SCRAPE_S, at a step of
# one second: $__rate_interval = max(4 × scrape interval, $__interval + scrape interval).
GRAFANA_VARS = {"__rate_interval": f"{4 * SCRAPE_S}s", "__interval": "1s"}
# An agent's pause between turns (its tool calls): a session then spans several scrapes.
THINK_S = 0.7
# Panels that must show more than zeros after the run: what the traffic itself moves. (The rest, e.g. store
# failures, decode stall under the pull policy, release failures, rightly stay at 0 on a healthy cluster.)
MUST_MOVE = {"TTFT by reuse source", "Gateway overhead", "Requests by status", "Handle outcomes",
             "Reused share of prompt tokens", "Reused and prompt tokens", "Guard tokenization and tokenizer mismatches",
             "Pinned sessions", "Placement decisions by option and reason",
             "Held KV tokens per decode node", "Held KV share per decode node",
             "Handle releases by reason", "Upstream errors by node and phase", "Nodes in service and scrape targets up",
             "vLLM KV cache usage", "Session store latency by operation"}
# Without a Redis server the gateway runs on its memory store, which is not measured.
EXCLUDED_WITHOUT_REDIS = {
    "Session store latency by operation": "the memory store's calls are not measured (kvtether_store_seconds "
                                          "covers a shared store only), and no redis-server is installed",
}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, check=False)


def alert_names() -> list[str]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [r["alert"] for g in doc["groups"] for r in g["rules"]]


def test_alert_rules_pass_promtool() -> None:
    out = promtool("check", "rules", str(ALERTS))
    assert out.returncode == 0, out.stdout + out.stderr
    names = alert_names()
    assert f"SUCCESS: {len(names)} rules found" in out.stdout, out.stdout
    assert len(set(names)) == len(names), "alert names must be unique"
    doc = yaml.safe_load(ALERTS.read_text())
    for rule in (r for g in doc["groups"] for r in g["rules"]):
        # An operator reads these in a page: each rule says what broke and what to check, and waits a while.
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule.get("for"), f"{rule['alert']} fires on one evaluation"


def test_alerts_fire_on_their_series_in_promtool_unit_tests() -> None:
    out = promtool("test", "rules", str(ALERT_TESTS))
    assert out.returncode == 0, out.stdout + out.stderr
    # Every alert of the file has a case where it fires.
    doc = yaml.safe_load(ALERT_TESTS.read_text())
    fired = {case["alertname"] for t in doc["tests"] for case in t["alert_rule_test"] if case.get("exp_alerts")}
    assert fired == set(alert_names())


def test_example_config_passes_promtool() -> None:
    out = promtool("check", "config", str(EXAMPLE_CONFIG))
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_lists_above_name_real_panels() -> None:
    titles = {title for title, _, _ in dashboard_queries()}
    assert not MUST_MOVE - titles and not set(EXCLUDED_WITHOUT_REDIS) - titles, titles


def test_every_gateway_metric_has_a_panel() -> None:
    exprs = " ".join(expr for _, _, expr in dashboard_queries())
    names = [v for k, v in vars(T).items() if k.startswith("M_")]
    assert names and not [n for n in names if not re.search(rf"\b{n}(_bucket|_count)?\b", exprs)]


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(panel title, refId, PromQL) of every target of every panel, with the dashboard's own variables filled
    in from their defaults and Grafana's built-ins from GRAFANA_VARS."""
    dash = json.loads(DASHBOARD.read_text())
    assert 38 <= dash["schemaVersion"] <= 40
    variables = dict(GRAFANA_VARS)
    templating = dash["templating"]["list"]
    assert any(v["type"] == "datasource" and v["query"] == "prometheus" for v in templating)
    for v in templating:
        if v["type"] in ("textbox", "constant", "custom"):
            variables[v["name"]] = v["current"]["value"]
    out = []
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = re.sub(r"\$\{?(\w+)\}?", lambda m: variables[m.group(1)], target["expr"])
            out.append((panel["title"], target["refId"], expr))
    return out


def scrape_config(gateway: str, prefill: list[str], decode: list[str], rules: Path) -> dict[str, Any]:
    """The example configuration with this run's targets, a one-second scrape, and the rule file by path: the
    job names and labels the rules and the dashboard rely on come from the example itself."""
    cfg = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    cfg["global"] = {"scrape_interval": f"{SCRAPE_S}s", "scrape_timeout": f"{SCRAPE_S}s",
                     "evaluation_interval": f"{SCRAPE_S}s"}
    cfg["rule_files"] = [str(rules)]
    cfg.pop("alerting", None)
    hostport = {"prefill": [urlsplit(u).netloc for u in prefill], "decode": [urlsplit(u).netloc for u in decode]}
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    jobs["kvtether-gateway"]["static_configs"] = [{"targets": [urlsplit(gateway).netloc]}]
    for static in jobs["vllm"]["static_configs"]:
        static["targets"] = hostport[static["labels"]["role"]]
    return cfg


@contextlib.contextmanager
def running_prometheus(config: Path, workdir: Path) -> Iterator[str]:
    """A throw-away Prometheus on a free port with its own storage; killed with its process group at the end."""
    assert PROMETHEUS is not None
    port = free_port()
    log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 - the child keeps it open
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def prometheus_log(workdir: Path) -> str:
    path = workdir / "prometheus.log"
    return path.read_text(errors="replace")[-2000:] if path.exists() else ""


async def api(client: httpx.AsyncClient, prom: str, path: str, **params: Any) -> Any:
    resp = await client.get(f"{prom}/api/v1/{path}", params=params)
    body = resp.json()
    assert resp.status_code == 200 and body["status"] == "success", (path, params, body)
    return body["data"]


async def until(check: Any, what: str, within_s: float = 20.0) -> Any:
    """Poll `check()` (async) until it returns something truthy; fail naming `what` and the last value."""
    deadline = time.monotonic() + within_s
    last: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if last := await check():
                return last
        await anyio.sleep(0.2)
    raise AssertionError(f"{what}: not within {within_s:.0f} s (last: {last!r})")


async def scalar(client: httpx.AsyncClient, prom: str, query: str) -> float:
    result = (await api(client, prom, "query", query=query))["result"]
    return sum(float(r["value"][1]) for r in result)


async def session(client: httpx.AsyncClient, url: str, n: int, turns: int, final: bool) -> None:
    """One agent session: every turn after the first extends the history (the handle is pulled); the last one
    ends the session when `final`, so its handle is released."""
    messages = first_messages(n)
    for t in range(turns):
        if t:
            await anyio.sleep(THINK_S)
        headers = {"x-session-id": f"dash-{n}"}
        if final and t == turns - 1:
            headers[FINAL_HEADER] = "true"
        got = await chat(client, url, request_body(messages, stream=t % 2 == 1), headers)
        messages = next_messages(messages, got, n, t, result_words=40)


@contextlib.asynccontextmanager
async def gateway_on_sim(tmp_path: Path, dead_prefill: str) -> AsyncIterator[tuple[SimCluster, str, bool]]:
    """One live prefill node, two decode nodes, and a configured prefill node that nobody listens at; the
    gateway on a Redis store when there is a redis-server (yields whether it is)."""
    spec = ClusterSpec(prefill=1, decode=2, speed=SPEED, kv_recompute_threshold=4, kv_lease_duration=3600.0)
    async with contextlib.AsyncExitStack() as stack:
        store = "memory"
        if server_binary() is not None:
            store = stack.enter_context(running_redis(tmp_path / "redis")).url
        cluster = await stack.enter_async_context(SimCluster(spec))
        # "pull": every turn after a session's first pulls its handle. Polls every 0.25 s: the dead node's
        # failed polls (4/s) pass KvtetherNodeUnreachable's 0.2/s over its 1 min window within a few seconds.
        cfg = load_config(None, prefill=[*cluster.prefill_urls, dead_prefill], decode=cluster.decode_urls,
                          policy="pull", store=store, metrics_poll_interval_s=0.25, retention_interval_s=0.5)
        url = await stack.enter_async_context(serve_gateway(cfg, app=create_app(cfg)))
        yield cluster, url, store != "memory"


def finite(result: list[dict[str, Any]]) -> list[float]:
    return [x for r in result for _, v in r["values"] if math.isfinite(x := float(v))]


@pytest.mark.anyio
async def test_every_dashboard_query_has_data_and_every_rule_loads(tmp_path: Path) -> None:
    queries = dashboard_queries()
    names = alert_names()
    dead = f"http://127.0.0.1:{free_port()}"
    async with gateway_on_sim(tmp_path, dead) as (cluster, url, shared_store), \
            httpx.AsyncClient(timeout=30, limits=LIMITS) as client:
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump(scrape_config(url, [*cluster.prefill_urls, dead], cluster.decode_urls,
                                                       ALERTS)))
        checked = await anyio.run_process([str(PROMTOOL), "check", "config", str(config)], check=False)
        assert checked.returncode == 0, (checked.stdout + checked.stderr).decode()
        with running_prometheus(config, tmp_path) as prom:
            try:
                await _watch(client, prom, url, dead, queries, names, with_store=shared_store)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n--- prometheus log (tail) ---\n{prometheus_log(tmp_path)}") from None


async def _watch(client: httpx.AsyncClient, prom: str, url: str, dead: str, queries: list[tuple[str, str, str]],
                 names: list[str], *, with_store: bool) -> None:
    await until(lambda: _ready(client, prom), "prometheus ready")
    started = time.time()

    async def scraped() -> bool:
        targets = (await api(client, prom, "targets"))["activeTargets"]
        up = {t["scrapeUrl"] for t in targets if t["health"] == "up"}
        return len(targets) == 5 and len(up) == 4 and f"{dead}/metrics" not in up

    await until(scraped, "every live target scraped")

    # Traffic while Prometheus watches, so rates move inside its window: two sessions that end (their
    # last turn is final: a release), one left open (its handle stays held on its decode node).
    async with anyio.create_task_group() as tg:
        tg.start_soon(session, client, url, 1, 4, True)
        tg.start_soon(session, client, url, 2, 3, True)
        tg.start_soon(session, client, url, 3, 3, False)

    # Prometheus has the end state: both releases and all ten requests scraped, then two more scrapes.
    await until(lambda: _at_least(client, prom, 'sum(kvtether_handle_releases_total{reason="final"})', 2),
                "both final releases scraped")
    await until(lambda: _at_least(client, prom, 'sum(kvtether_requests_total{status="2xx"})', 10),
                "all requests scraped")
    await anyio.sleep(2 * SCRAPE_S)

    # Every panel query, as Grafana sends it: a range query over the run at a one-second step.
    end = time.time()
    empty = []
    peaks: dict[str, float] = {}
    for title, ref, expr in queries:
        if not with_store and title in EXCLUDED_WITHOUT_REDIS:
            warnings.warn(f"panel not checked: {title}: {EXCLUDED_WITHOUT_REDIS[title]}", stacklevel=1)
            continue
        result = (await api(client, prom, "query_range", query=expr, start=started - 5, end=end,
                            step=f"{SCRAPE_S}s"))["result"]
        values = finite(result)
        if not values:
            empty.append(f"{title} [{ref}]: {expr} -> {result}")
        peaks[title] = max([peaks.get(title, 0.0), *values])
    assert not empty, "panel queries without data:\n" + "\n".join(empty)
    flat = sorted(t for t in MUST_MOVE if t in peaks and peaks[t] <= 0)
    assert not flat, f"panels that stayed at 0 through the run: {flat}"

    # Every rule of the file is loaded and has evaluated without error.
    async def evaluated() -> dict[str, dict[str, Any]] | None:
        groups = (await api(client, prom, "rules"))["groups"]
        rules = {r["name"]: r for g in groups for r in g["rules"]}
        done = all(not r["lastEvaluation"].startswith("0001") for r in rules.values())
        return rules if done and set(rules) == set(names) else None

    rules = await until(evaluated, "every rule evaluated")
    bad = {n: (r["health"], r.get("lastError")) for n, r in rules.items() if r["health"] != "ok"}
    assert not bad, bad
    assert all(r["type"] == "alerting" for r in rules.values())

    # The node down is seen three times (Prometheus cannot scrape it; the gateway's polls of it fail; the gateway
    # has taken it out of service); the healthy rest trips nothing. Pending, not firing: the run is shorter than
    # any rule's `for:`.
    dead_hostport = urlsplit(dead).netloc

    async def node_alerts() -> set[tuple[str, str, str]] | None:
        active = {(a["labels"]["alertname"], a["labels"].get("node") or a["labels"].get("instance", ""), a["state"])
                  for a in (await api(client, prom, "alerts"))["alerts"]}
        return active if want <= active else None

    want = {("KvtetherNodeUnreachable", dead, "pending"), ("VllmNodeDown", dead_hostport, "pending"),
            ("KvtetherNodeOutOfService", dead, "pending")}
    active = await until(node_alerts, "the dead node's alerts pending")
    assert active == want, active


async def _ready(client: httpx.AsyncClient, prom: str) -> bool:
    return (await client.get(f"{prom}/-/ready")).status_code == 200


async def _at_least(client: httpx.AsyncClient, prom: str, query: str, value: float) -> bool:
    return await scalar(client, prom, query) >= value

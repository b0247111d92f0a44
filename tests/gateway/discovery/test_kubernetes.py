"""Kubernetes discovery against a scripted API server on 127.0.0.1 (fake_apiserver.py): the real lightkube client
lists and watches over HTTP; the test changes pods and checks the desired node set each step publishes, and how
the watch resumed (from the last version after a cut stream, a relist after 410 Gone)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

import anyio
import pytest
from kvtether.gateway.nodes.discovery import Member, load_discovery
from kvtether.gateway.nodes.discovery.kubernetes import KubernetesDiscovery

from tests.gateway.discovery.fake_apiserver import TOKEN, FakeApiServer, kubeconfig, pod, serving
from tests.gateway.discovery.waiting import until

pytestmark = pytest.mark.anyio

P0, D0, D1, D2 = "http://10.0.0.10:8000", "http://10.0.0.20:8000", "http://10.0.0.21:8000", "http://10.0.0.22:8000"


class Seen:
    """What discovery published, newest last."""

    def __init__(self) -> None:
        self.sets: list[dict[str, Member]] = []

    def __call__(self, desired: Mapping[str, Member]) -> None:
        self.sets.append(dict(desired))

    @property
    def last(self) -> dict[str, Member]:
        return self.sets[-1] if self.sets else {}

    async def until(self, check: Callable[[dict[str, Member]], bool], within_s: float = 10.0) -> None:
        await until(lambda: check(self.last), within_s)


def _serving(*urls: str) -> Callable[[dict[str, Member]], bool]:
    return lambda s: {u for u, m in s.items() if not m.draining} == set(urls)


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[FakeApiServer, Path]]:
    server = FakeApiServer()
    async with serving(server) as url:
        path = tmp_path / "kubeconfig"
        path.write_text(kubeconfig(url))
        yield server, path


def _discovery(path: Path, **extra: object) -> KubernetesDiscovery:
    return KubernetesDiscovery(load_discovery({"source": "kubernetes", "kubeconfig": str(path), "namespace": "kv",
                                               "retry_s": 0.05, "retry_max_s": 0.2, **extra}))


async def test_list_then_watch_follows_pods_through_ready_terminating_and_deleted(
        api: tuple[FakeApiServer, Path]) -> None:
    server, path = api
    server.put(pod("p0", "10.0.0.10", "prefill"))
    server.put(pod("d0", "10.0.0.20", "decode"))
    server.put(pod("d1", "10.0.0.21", "decode", ready=False))  # starting: not a node yet
    server.put(pod("x", "10.0.0.99", None))  # no role label: not a node
    server.put(pod("other", "10.0.0.98", "decode", labels={"app.kubernetes.io/part-of": "else"}))  # not selected
    seen, disc = Seen(), _discovery(path)
    async with anyio.create_task_group() as tg:
        tg.start_soon(disc.run, seen)
        await seen.until(_serving(P0, D0))
        assert seen.last[P0] == Member("prefill") and seen.last[D0] == Member("decode")
        # The list's version is where the watch starts, with the selector on both.
        await until(lambda: len(server.watches()) == 1)
        listed = server.lists()[0]
        assert listed["labelSelector"] == "app.kubernetes.io/part-of=kvtether"
        assert listed["authorization"] == f"Bearer {TOKEN}" == server.watches()[0]["authorization"]
        assert server.watches()[0]["resourceVersion"] == str(105)
        assert server.watches()[0]["labelSelector"] == listed["labelSelector"]

        server.put(pod("d1", "10.0.0.21", "decode"))  # turned Ready
        await seen.until(_serving(P0, D0, D1))
        server.put(pod("d0", "10.0.0.20", "decode", deleting=True))  # terminating: drains
        await seen.until(lambda s: s.get(D0) == Member("decode", draining=True))
        server.delete("d0")
        await seen.until(lambda s: D0 not in s and _serving(P0, D1)(s))
        tg.cancel_scope.cancel()
    assert disc.lists == 1


async def test_a_cut_watch_resumes_from_the_last_version_and_bookmarks_move_it(
        api: tuple[FakeApiServer, Path]) -> None:
    server, path = api
    server.put(pod("p0", "10.0.0.10", "prefill"))
    server.put(pod("d0", "10.0.0.20", "decode"))
    seen, disc = Seen(), _discovery(path)
    async with anyio.create_task_group() as tg:
        tg.start_soon(disc.run, seen)
        await seen.until(_serving(P0, D0))
        await until(lambda: len(server.watches()) == 1)
        server.put(pod("d1", "10.0.0.21", "decode"))
        await seen.until(_serving(P0, D0, D1))
        server.bookmark()
        await until(lambda: disc.version == str(server.version))
        at = server.version
        server.sever()  # the stream is cut mid-way
        await until(lambda: len(server.watches()) == 2)
        assert server.watches()[1]["resourceVersion"] == str(at)  # resumed, not listed again
        server.put(pod("d2", "10.0.0.22", "decode"))  # an event after the cut still arrives
        await seen.until(_serving(P0, D0, D1, D2))
        tg.cancel_scope.cancel()
    assert disc.lists == 1 and len(server.lists()) == 1 and disc.resumes >= 1


async def test_410_gone_relists_and_drops_what_the_new_list_does_not_show(api: tuple[FakeApiServer, Path]) -> None:
    server, path = api
    server.put(pod("p0", "10.0.0.10", "prefill"))
    server.put(pod("d0", "10.0.0.20", "decode"))
    server.put(pod("d1", "10.0.0.21", "decode"))
    seen, disc = Seen(), _discovery(path)
    async with anyio.create_task_group() as tg:
        tg.start_soon(disc.run, seen)
        await seen.until(_serving(P0, D0, D1))
        await until(lambda: len(server.watches()) == 1)
        # While the client is cut off, d0 goes and d2 comes, and the server forgets those events: the resumed watch
        # gets 410 Gone, and only a new list can tell.
        server.delete("d0", event=False)
        server.put(pod("d2", "10.0.0.22", "decode"), event=False)
        server.compact()
        server.sever()
        await seen.until(lambda s: set(s) == {P0, D1, D2})
        tg.cancel_scope.cancel()
    assert disc.lists == 2 and len(server.lists()) == 2
    assert server.watches()[1]["resourceVersion"] != server.watches()[-1]["resourceVersion"]


async def test_two_replicas_reach_the_same_view_without_talking(api: tuple[FakeApiServer, Path]) -> None:
    server, path = api
    server.put(pod("p0", "10.0.0.10", "prefill"))
    server.put(pod("d0", "10.0.0.20", "decode"))
    a, b = Seen(), Seen()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_discovery(path).run, a)
        await a.until(_serving(P0, D0))
        server.put(pod("d1", "10.0.0.21", "decode"))
        server.put(pod("d0", "10.0.0.20", "decode", deleting=True))
        tg.start_soon(_discovery(path).run, b)  # a replica that starts later: it lists what the first watched
        for seen in (a, b):
            await seen.until(lambda s: s.get(D0) == Member("decode", draining=True) and D1 in s)
        assert a.last == b.last
        tg.cancel_scope.cancel()


async def test_the_role_comes_from_llm_d_labels_and_the_port_from_the_named_container_port(
        api: tuple[FakeApiServer, Path]) -> None:
    server, path = api
    server.put(pod("n0", "10.0.0.30", None, labels={"llm-d.ai/role": "prefill-decode"}, port=8100))
    server.put(pod("n1", "fd00::31", None, labels={"llm-d.ai/role": "decode"}))
    seen, disc = Seen(), _discovery(path)
    async with anyio.create_task_group() as tg:
        tg.start_soon(disc.run, seen)
        await seen.until(lambda s: len(s) == 2)
        assert seen.last == {"http://10.0.0.30:8100": Member("both"), "http://[fd00::31]:8000": Member("decode")}
        tg.cancel_scope.cancel()


async def test_an_api_server_that_is_away_is_retried(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(kubeconfig("http://127.0.0.1:9"))  # nothing listens there
    seen, disc = Seen(), _discovery(path)
    with anyio.move_on_after(0.5):
        await disc.run(seen)
    assert seen.sets == [] and disc.lists == 0


async def test_a_gateway_serves_the_pods_it_finds_and_moves_a_session_off_a_deleted_one(
        api: tuple[FakeApiServer, Path]) -> None:
    """The gateway as `kvtether serve` builds it (discovery from its settings) on a simulated cluster whose nodes
    the scripted API server lists as pods: it serves once the pods are polled, and a session whose decode pod is
    being deleted moves at its next turn, answered as the oracle answers."""
    import httpx
    from kvtether.gateway.config import load_config
    from kvtether.gateway.shell.app import create_app
    from kvtether.gateway.shell.server import serve_gateway
    from kvtether.sim.cluster import ClusterSpec, SimCluster

    from tests.support.gateway_agent import chat, comparable, first_messages, next_messages, request_body
    from tests.support.sim_rig import LIMITS, SPEED

    server, path = api
    spec = ClusterSpec(prefill=1, decode=2, speed=SPEED, kv_recompute_threshold=4, kv_lease_duration=3600.0)
    async with SimCluster(spec) as cluster, SimCluster(ClusterSpec(prefill=0, decode=0, aggregated=1,
                                                                    speed=SPEED)) as oracle:
        urls = {"p0": cluster.prefill_urls[0], "d0": cluster.decode_urls[0], "d1": cluster.decode_urls[1]}
        for name, url in urls.items():
            port = int(url.rsplit(":", 1)[1])
            server.put(pod(name, "127.0.0.1", "prefill" if name == "p0" else "decode", port=port))
        cfg = load_config(None, policy="pull", metrics_poll_interval_s=0.2,
                          discovery={"source": "kubernetes", "kubeconfig": str(path), "namespace": "kv"})
        app = create_app(cfg)
        gw = app.state.gateway
        async with serve_gateway(cfg, app=app) as url, httpx.AsyncClient(timeout=60, limits=LIMITS) as client:
            await until(lambda: sum(n.routable for n in gw.cluster.nodes.values()) == 3)
            messages, headers = first_messages(7), {"x-session-id": "k8s-7"}
            for turn in range(3):
                if turn == 2:
                    pinned = (await client.get(f"{url}/admin/sessions")).json()[0]["decode"]
                    name = next(n for n, u in urls.items() if u == pinned)
                    port = int(pinned.rsplit(":", 1)[1])
                    server.put(pod(name, "127.0.0.1", "decode", port=port, deleting=True))
                    # Draining, or already gone (nothing of this gateway runs there between turns).
                    await until(lambda left=pinned: left not in gw.cluster.nodes or not gw.cluster.nodes[left].routable)
                body = request_body(messages, stream=turn == 1)
                got = await chat(client, url, body, headers)
                want = await chat(client, oracle.aggregated_urls[0], {**body, "stream": False}, clean=False)
                assert comparable(got) == comparable(want), turn
                messages = next_messages(messages, got, 7, turn)
            moved = (await client.get(f"{url}/admin/sessions")).json()[0]["decode"]
            assert moved != pinned and moved in cluster.decode_urls
            server.delete(name)
            await until(lambda: pinned not in gw.cluster.nodes)


async def test_missing_credentials_are_waited_out_not_raised(tmp_path: Path) -> None:
    seen, disc = Seen(), _discovery(tmp_path / "no-such-kubeconfig")
    with anyio.move_on_after(0.3):
        await disc.run(seen)  # logs and waits for credentials to appear; the gateway keeps serving its static nodes
    assert seen.sets == [] and disc.lists == 0

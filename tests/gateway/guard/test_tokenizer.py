"""The guard's local tokenizer: vLLM's rendering rules (pure), cached pieces against whole-text encoding, trust
per model (unchecked → verified, a mismatch → /tokenize for good, counted), and the gateway falling back to
/tokenize when its local tokenizer disagrees with the engine (the simulator, whose tokenizer is its own).

Equality with real vLLM's /tokenize is tests/vllm/test_tokenizer.py's job (marker vllm). The HF tokenizer
here is built in the test from `tokenizers` (no downloads), with the tiny model's chat template.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import httpx
import jinja2
import pytest
from kvtether.gateway import telemetry as T
from kvtether.gateway.config import load_config
from kvtether.gateway.guard import chat_render as R
from kvtether.gateway.guard.tokencheck import GuardTokenizer, Trust, probes
from kvtether.gateway.guard.tokenizer import LocalTokenizer
from kvtether.gateway.nodes.cluster import Cluster, sample_sum
from kvtether.gateway.stores import open_store
from kvtether.gateway.transport.upstream import Upstream
from kvtether.gateway.turn import body as B
from kvtether.gateway.turn.context import Progress, TurnContext
from kvtether.gateway.turn.orchestrator import Orchestrator
from kvtether.gateway.turn.tokenize import tokenize
from opentelemetry import trace

from tests.support.gateway_agent import MODEL, first_messages, next_messages, request_body

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[3]


def _tiny_template() -> str:
    spec = importlib.util.spec_from_file_location("build_tiny_model", ROOT / "scripts" / "build_tiny_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer trained here on stdlib source, ChatML specials, the tiny model's template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [Path(json.__file__).with_name(n).read_text() for n in ("decoder.py", "encoder.py", "scanner.py")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>",
                                   additional_special_tokens=["<|endoftext|>", "<|im_start|>"])
    fast.chat_template = _tiny_template()
    out = tmp_path_factory.mktemp("hf-tokenizer")
    fast.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def local(hf_dir: Path) -> LocalTokenizer:
    return LocalTokenizer.load(str(hf_dir))


# ---- vLLM's rendering rules (pure) -----------------------------------------------------------------


def test_tools_are_dumped_as_vllm_dumps_them() -> None:
    tools = [{"type": "function", "defer_loading": True, "x": 1,
              "function": {"name": "f", "parameters": {"type": "object"}, "extra": 2}},
             {"function": {"name": "g", "description": "d", "strict": True}}]
    assert R.tools_for_template(tools) == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": {"type": "object"},
                                          "defer_loading": True}, "defer_loading": True},
        {"type": "function", "function": {"name": "g", "description": "d", "parameters": None, "strict": True}}]
    assert R.tools_for_template(None) is None
    with pytest.raises(R.Unsupported):
        R.tools_for_template([{"type": "retrieval"}])


def test_messages_are_rebuilt_as_vllm_rebuilds_them() -> None:
    messages = [
        {"role": "system", "content": "x-anthropic-billing-header: cch=1\nBe brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache": 1},
                                     {"type": "text", "text": None}], "name": "u"},
        {"role": "assistant", "content": None, "reasoning": "why", "extra": 3,
         "tool_calls": [{"type": "function", "id": "c", "function": {"name": "f", "arguments": '{"p": 1}'}}]},
        {"role": "assistant", "content": "x", "tool_calls": []},
        {"role": "tool", "tool_call_id": "c",
         "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
    ]
    as_string = R.conversation(messages, "string")
    assert as_string[0] == {"role": "system", "content": "Be brief."}
    assert as_string[1] == {"role": "user", "content": "a\nb", "name": "u"}
    assert as_string[2] == {"role": "assistant", "content": "", "reasoning": "why", "reasoning_content": "why",
                            "tool_calls": [{"id": "c", "function": {"arguments": {"p": 1}, "name": "f"},
                                            "type": "function"}]}
    assert as_string[3] == {"role": "assistant", "content": "x"}  # an empty tool_calls list is dropped
    assert as_string[4] == {"role": "tool", "content": "r1\nr2", "tool_call_id": "c"}
    as_parts = R.conversation(messages, "openai")
    assert as_parts[1]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache": 1}]
    assert as_parts[4]["content"] == "r1\nr2"  # a tool result's parts are joined in either format
    bad_args = R.conversation([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "["}}]}],
                              "string")
    assert bad_args[0]["tool_calls"][0]["function"]["arguments"] == {}
    with pytest.raises(R.Unsupported):
        R.conversation([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "string")


def test_content_format_follows_the_template() -> None:
    env = jinja2.Environment()
    assert R.content_format(env, "{% for m in messages %}{{ m['content'] }}{% endfor %}") == "string"
    assert R.content_format(env, "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}"
                                 "{% endfor %}") == "openai"
    assert R.content_format(env, _tiny_template()) == "openai"  # through a macro parameter


def test_template_arguments_merge_as_in_vllm() -> None:
    payload = {"add_generation_prompt": True, "chat_template_kwargs": {"enable_thinking": False, "effort": "auto",
                                                                        "x": None}}
    assert R.template_kwargs(payload, None) == {"enable_thinking": False, "add_generation_prompt": True,
                                                "continue_final_message": False}
    assert "tools" in R.template_kwargs({}, [{"type": "function"}])
    for bad in ({"chat_template": "t"}, {"chat_template_kwargs": {"tokenize": True}},
                {"add_generation_prompt": True, "continue_final_message": True}):
        with pytest.raises(R.Unsupported):
            R.template_kwargs(bad, None)
    assert R.accepted({"a": 1, "enable_thinking": 1, "documents": 2}, frozenset({"enable_thinking"}),
                      frozenset({"documents"})) == {"enable_thinking": 1, "documents": 2}


def test_developer_messages_become_one_system_message() -> None:
    msgs = [{"role": "system", "content": "s"}, {"role": "developer", "content": "d", "tools": None},
            {"role": "user", "content": "u"}]
    assert R.developer_as_system(msgs, "{{ messages }}") == [{"role": "system", "content": "s\n\nd"},
                                                              {"role": "user", "content": "u"}]
    assert R.developer_as_system(msgs, "{% if m.role == 'developer' %}{% endif %}") == msgs


def test_tokenize_body_renames_reasoning_content() -> None:
    body = {"model": "m", "messages": [{"role": "assistant", "content": "a", "reasoning_content": "r"},
                                       {"role": "user", "content": "u"}]}
    out = B.tokenize_body("chat", body)
    assert out is not None and out["messages"][0] == {"role": "assistant", "content": "a", "reasoning": "r"}
    assert body["messages"][0]["reasoning_content"] == "r"  # the client's body is not changed


# ---- encoding --------------------------------------------------------------------------------------


def _whole(local: LocalTokenizer, payload: dict[str, Any]) -> list[int]:
    text, special = local.render(payload)
    return list(local.hf(text, add_special_tokens=special)["input_ids"])


def test_cached_pieces_equal_whole_text_encoding(local: LocalTokenizer) -> None:
    assert local._split is not None  # a byte-level tokenizer: pieces between added tokens are independent
    messages = first_messages(3)
    bodies = [*probes(MODEL), B.tokenize_body("chat", request_body(messages, stream=True))]
    for turn in range(4):
        answer = {"role": "assistant", "content": f"Step {turn}: <|im_end|> inside text, and  spaces\n",
                  "reasoning_content": "thinking"}
        messages = next_messages(messages, answer, 3, turn)
        bodies.append(B.tokenize_body("chat", request_body(messages, stream=False)))
    for payload in bodies:
        assert payload is not None
        assert local.encode_sync(payload) == _whole(local, payload)


@pytest.mark.wall_clock  # the guard's tokenizer encodes in worker threads
async def test_long_prompts_encode_in_a_worker_thread(local: LocalTokenizer) -> None:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 5000 + "end"}]}
    assert await local.encode(payload) == _whole(local, payload)
    assert await local.encode({"model": MODEL, "prompt": "text " * 2000}) == local.hf("text " * 2000)["input_ids"]


def test_trust_moves_from_unchecked_to_verified_and_a_mismatch_disables() -> None:
    metrics = T.Metrics()
    draws = iter([0.5, 0.01])
    g = GuardTokenizer("tok", metrics, check_share=0.02, rng=lambda: next(draws))
    assert g.trust("m") is Trust.UNCHECKED and g.wants_check("m")
    assert g.compare("m", [1, 2], [1, 2], "turn") and g.trust("m") is Trust.VERIFIED
    assert not g.wants_check("m")  # 0.5 ≥ 2 %
    assert g.wants_check("m")  # 0.01 < 2 %: sampled
    assert not g.compare("m", [1, 2], [1, 3], "turn") and g.trust("m") is Trust.DISABLED
    assert sample_sum(_metrics(metrics), "kvtether_tokenizer_mismatches_total", check="turn") == 1
    assert g.trust("other") is Trust.UNCHECKED  # per model


def _metrics(metrics: T.Metrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()


# ---- the request path ------------------------------------------------------------------------------


async def test_turns_use_local_ids_once_they_match_and_switch_back_on_a_mismatch(local: LocalTokenizer) -> None:
    """tokenize.tokenize: unchecked → compared with /tokenize; verified → local only; sampled → compared again; a
    mismatch → the engine's ids, and /tokenize for this model from then on."""
    asked: list[dict[str, Any]] = []
    wrong = {"on": False}

    def p_node(request: httpx.Request) -> httpx.Response:
        payload = json.loads(request.content)
        asked.append(payload)
        ids = local.encode_sync(payload)
        return httpx.Response(200, json={"tokens": [*ids, 7] if wrong["on"] else ids})

    cfg = load_config(None, prefill=["http://p0:8000"], decode=["http://d0:8000"], tokenizer="unused",
                      tokenizer_check_share=0.0)
    client = httpx.AsyncClient(transport=httpx.MockTransport(p_node))
    orch = Orchestrator(cfg, Cluster(cfg, client), open_store(cfg), T.Metrics(), Upstream(), client)
    sv = orch.sv
    assert sv.tokenizer is not None
    sv.tokenizer.loaded(local)
    body = request_body(first_messages(1), stream=True)

    def ctx() -> TurnContext:
        return TurnContext("chat", body, {}, True, False, "s", "header", None, 0.0,
                           trace.NonRecordingSpan(trace.INVALID_SPAN_CONTEXT))

    want = local.encode_sync(B.tokenize_body("chat", body) or {})
    assert await tokenize(sv, ctx(), Progress()) == want and len(asked) == 1  # unchecked: compared
    assert sv.tokenizer.trust(MODEL) is Trust.VERIFIED
    assert await tokenize(sv, ctx(), Progress()) == want and len(asked) == 1  # verified: local only
    sv.tokenizer.check_share = 1.0
    wrong["on"] = True
    assert await tokenize(sv, ctx(), Progress()) == [*want, 7] and len(asked) == 2  # sampled, differs: the engine's ids
    assert sv.tokenizer.trust(MODEL) is Trust.DISABLED
    assert await tokenize(sv, ctx(), Progress()) == [*want, 7] and len(asked) == 3  # /tokenize from now on
    text = _metrics(sv.metrics)
    assert sample_sum(text, "kvtether_tokenizer_mismatches_total", check="turn") == 1
    assert sample_sum(text, "kvtether_guard_tokenize_total", source="local") == 1
    await client.aclose()


@pytest.mark.wall_clock  # the guard's tokenizer loads in a worker thread
async def test_a_tokenizer_that_differs_from_the_engine_falls_back_to_tokenize(hf_dir: Path) -> None:
    """Against the simulator (its tokenizer is its own): the start-up check finds the difference, counts it,
    and every guarded turn asks /tokenize; the turns still pull and equal the oracle."""
    import anyio

    from tests.support.sim_rig import outcome, rig, run_session

    async with rig(tokenizer=str(hf_dir)) as r:
        metrics = r.gw.metrics
        for _ in range(600):  # the start-up check runs in the background (it loads transformers)
            if sample_sum(_metrics(metrics), "kvtether_tokenizer_mismatches_total", check="startup") >= 1:
                break
            await anyio.sleep(0.05)
        assert r.gw.orchestrator.sv.tokenizer.trust(MODEL) is Trust.DISABLED
        await run_session(r, 7, 4, check_pull=True)
        text = _metrics(metrics)
        assert sample_sum(text, "kvtether_guard_tokenize_total", source="local") == 0
        assert sample_sum(text, "kvtether_guard_tokenize_total", source="remote") >= 3
        assert await outcome(r, "attached") >= 3


@pytest.mark.wall_clock  # the guard's tokenizer encodes in worker threads
async def test_a_turn_the_guard_does_not_check_warms_the_cache_for_the_next_one(local: LocalTokenizer) -> None:
    """A session's first turn is not checked, but its prompt is the next turn's history: gather encodes it in the
    background, so the first checked turn finds its pieces cached."""
    from kvtether.gateway.turn.gather import gather

    cfg = load_config(None, prefill=["http://p0:8000"], decode=["http://d0:8000"], tokenizer="unused")
    client = httpx.AsyncClient()
    orch = Orchestrator(cfg, Cluster(cfg, client), open_store(cfg), T.Metrics(), Upstream(), client)
    sv = orch.sv
    assert sv.tokenizer is not None
    sv.tokenizer.loaded(local)
    messages = [{"role": "system", "content": "You are a warm-up test agent."},
                {"role": "user", "content": "A document no other test sends: " + "lorem ipsum dolor " * 300}]
    body = request_body(messages, stream=True)
    payload = B.tokenize_body("chat", body)
    assert payload is not None
    text, special = local.render(payload)
    assert local._pieces(text, special)[1], "the prompt's pieces must not be cached before the turn"
    ctx = TurnContext("chat", body, {}, True, False, "warm", "header", None, 0.0,
                      trace.NonRecordingSpan(trace.INVALID_SPAN_CONTEXT))
    gathered = await gather(sv, ctx, 0, Progress())
    assert gathered.prompt_ids is None  # the first turn is not tokenized for the guard ...
    await sv.tokenizer.warmed()
    assert local._pieces(text, special)[1] == []  # ... but its pieces are cached for the next one
    await client.aclose()

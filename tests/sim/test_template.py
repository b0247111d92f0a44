"""Chat template: ChatML with Qwen3's tools and reasoning rules, tool calls in the hermes or glm47 format;
generated turns re-render exactly."""

from __future__ import annotations

import json

import pytest
from kvtether.sim.model import GenerationSpec, Model
from kvtether.sim.parsers import ChatOutputParser, parse_chat_output
from kvtether.sim.template import GLM47, TOOL_FORMATS, TemplateError, render_chat, render_tool_call
from kvtether.sim.tokenizer import Tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


def test_plain_chatml_and_generation_prompt() -> None:
    text = render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    no_gen = render_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert no_gen == "<|im_start|>user\nHi<|im_end|>\n"


def test_tools_go_into_the_system_prompt() -> None:
    text = render_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], tools=TOOLS)
    assert text.startswith("<|im_start|>system\nS\n\n# Tools")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert text.count("<|im_start|>system") == 1


def test_tool_calls_and_results() -> None:
    args = '{"city": "Paris"}'
    msgs = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "warm"},
    ]
    text = render_chat(msgs, tools=TOOLS)
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response>" in text


def test_reasoning_kept_only_after_last_user() -> None:
    msgs = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "reasoning": "r2"},
    ]
    text = render_chat(msgs, add_generation_prompt=False)
    assert "r1" not in text
    assert "<|im_start|>assistant\n<think>\nr2\n</think>\n\na2<|im_end|>" in text


def test_bad_messages_raise() -> None:
    with pytest.raises(TemplateError):
        render_chat([])
    with pytest.raises(TemplateError):
        render_chat([{"role": "wizard", "content": "x"}])


@pytest.mark.parametrize("fmt", TOOL_FORMATS)
@pytest.mark.parametrize(
    ("tools", "thinking", "choice"),
    [((), False, "auto"), ((), True, "auto"), (tuple(TOOLS), False, "required"), (tuple(TOOLS), True, "required")],
)
def test_generated_turn_re_renders_to_the_same_tokens(tools: tuple, thinking: bool, choice: str, fmt: str) -> None:
    tok = Tokenizer()
    model = Model(tok)
    msgs: list[dict] = [{"role": "user", "content": "What is the weather in Paris?"}]
    prompt = tok.encode(render_chat(msgs, tools=list(tools) or None, enable_thinking=thinking, tool_format=fmt))
    for seed in range(5):
        spec = GenerationSpec(tools=tools, tool_choice=choice, enable_thinking=thinking, temperature=0,
                              tool_format=fmt)
        plan = model.plan(seed.to_bytes(16, "little"), spec)
        out = [*plan.body, tok.eos_id]
        parsed = parse_chat_output(tok, out, parse_tools=bool(tools), tool_format=fmt)
        assert bool(parsed.tool_calls) == bool(tools)
        assert bool(parsed.reasoning) == thinking
        message: dict = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [
                {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
                for t in parsed.tool_calls
            ]
            json.loads(parsed.tool_calls[0].arguments)
        follow = {"role": "tool", "content": "ok"} if tools else {"role": "user", "content": "thanks"}
        again = tok.encode(
            render_chat([*msgs, message, follow], tools=list(tools) or None, enable_thinking=thinking, tool_format=fmt)
        )
        held = prompt + out
        if thinking and not tools:
            # Qwen3 drops reasoning before the last user message: NOT a prefix any more (on purpose).
            assert again[: len(held)] != held
        else:
            assert again[: len(held)] == held


NESTED = [
    {
        "type": "function",
        "function": {
            "name": "edit_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "lines": {"type": "array", "items": {"type": "integer"}},
                    "opts": {"type": "object", "properties": {"dry": {"type": "boolean"}, "n": {"type": "number"}}},
                },
                "required": ["path", "lines", "opts"],
            },
        },
    }
]


@pytest.mark.parametrize("fmt", TOOL_FORMATS)
@pytest.mark.parametrize("thinking", [False, True])
def test_streamed_deltas_assemble_to_the_non_streamed_parse(thinking: bool, fmt: str) -> None:
    tok = Tokenizer()
    model = Model(tok)
    for seed in range(20):
        spec = GenerationSpec(tools=tuple(NESTED + TOOLS), tool_choice="required", enable_thinking=thinking,
                              tool_format=fmt)
        out = [*model.plan(seed.to_bytes(16, "little"), spec).body, tok.eos_id]
        want = parse_chat_output(tok, out, tool_format=fmt)
        parser = ChatOutputParser(tok, tool_format=fmt)
        content = reasoning = ""
        calls: dict[int, dict[str, str]] = {}
        first_call_at = None
        for i, t in enumerate(out):
            d = parser.push(t)
            content += d.content
            reasoning += d.reasoning
            assert sum(bool(x) for x in (d.content, d.reasoning, d.tool_calls)) <= 1  # one kind per token
            for tc in d.tool_calls:
                entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                if tc.id is not None:
                    assert not entry["id"] and tc.name  # id and name come once, together
                    entry["id"], entry["name"] = tc.id, tc.name
                    first_call_at = i if first_call_at is None else first_call_at
                entry["arguments"] += tc.arguments or ""
        assert (content or None) == want.content and (reasoning or None) == want.reasoning
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [(c.name, c.arguments) for c in want.tool_calls]
        assert [c["id"] for c in calls.values()] == [c.id for c in parser.tool_calls]  # same id as the final call
        # The name goes out a few tokens into the call, before its arguments are complete (a glm47 call of
        # one short argument is a dozen tokens in all).
        assert first_call_at is not None and first_call_at < len(out) - (3 if fmt == GLM47 else 8)


def test_reasoning_and_content_stream_token_by_token() -> None:
    tok = Tokenizer()
    out = [*tok.encode("<think>\nLet me think about it.\n</think>\n\nThe answer is here."), tok.eos_id]
    parser = ChatOutputParser(tok)
    deltas = [parser.push(t) for t in out]
    reasoning = [d.reasoning for d in deltas if d.reasoning]
    content = [d.content for d in deltas if d.content]
    assert reasoning == ["Let", " me", " think", " about", " it", "."]
    assert content == ["The", " answer", " is", " here", "."]


# --- GLM-4.7 / GLM-5 tool calls (vLLM --tool-call-parser glm47) ------------------------------------------


def test_glm47_call_is_written_as_key_value_tags() -> None:
    text = render_tool_call("edit_file", '{"path": "a.py", "lines": [1, 2], "dry": true}', GLM47)
    assert text == (
        "<tool_call>edit_file<arg_key>path</arg_key><arg_value>a.py</arg_value>"
        "<arg_key>lines</arg_key><arg_value>[1, 2]</arg_value><arg_key>dry</arg_key><arg_value>true</arg_value>"
        "</tool_call>"
    )
    # Every tag is one special token, as in GLM's tokenizer.
    tok = Tokenizer()
    assert tok.encode("<arg_key>") == [tok.special("<arg_key>")]
    assert all(tok.is_special(tok.special(t)) for t in ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"))
    sys = render_chat([{"role": "user", "content": "u"}], tools=TOOLS, tool_format=GLM47)
    assert "<tool_call>{function-name}<arg_key>" in sys and '{"name": <function-name>' not in sys


def test_glm47_arguments_must_be_a_json_object() -> None:
    for bad in ("[1, 2]", "not json"):
        msgs = [{"role": "user", "content": "u"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": bad}}]}]
        with pytest.raises(TemplateError):
            render_chat(msgs, tool_format=GLM47)
        render_chat(msgs)  # hermes inserts the text verbatim, whatever it is


def test_missing_or_empty_arguments_render_as_an_empty_object_in_both_formats() -> None:
    """vLLM sets a history call's arguments that are missing, null or "" to {} before the template: a streamed
    call cut off after its name is resent so, and must not fail the session's next turn."""
    def with_args(fmt: str, **fn: object) -> str:
        msgs = [{"role": "user", "content": "u"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", **fn}}]}]
        return render_chat(msgs, tool_format=fmt)

    for fmt in TOOL_FORMATS:
        empty = with_args(fmt, arguments="{}")
        assert (with_args(fmt, arguments="") == with_args(fmt, arguments=None) == with_args(fmt)
                == with_args(fmt, arguments={}) == empty)
        assert render_tool_call("f", "{}", fmt) in empty


def _first_delta_token(tok: Tokenizer, ids: list[int], fmt: str) -> int:
    parser = ChatOutputParser(tok, tool_format=fmt)
    return next(i for i, t in enumerate(ids) if not parser.push(t).empty())


def test_glm47_name_goes_out_with_the_first_arg_key_hermes_much_later() -> None:
    """The first delta of a tool-call answer is the name: what decides its hold-back after the first token."""
    tok = Tokenizer()
    args = '{"path": "src/main.py"}'
    glm = tok.encode(render_tool_call("read_file", args, GLM47))
    hermes = tok.encode(render_tool_call("read_file", args))
    name_tokens = len(tok.encode("read_file"))
    # <tool_call>, the name's tokens, then <arg_key>: the name goes out on that token.
    assert _first_delta_token(tok, glm, GLM47) == name_tokens + 1
    assert glm[name_tokens + 1] == tok.special("<arg_key>")
    # hermes needs `<tool_call>\n{"name": "read_file"` closed first.
    assert _first_delta_token(tok, hermes, "hermes") == len(tok.encode('<tool_call>\n{"name": "read_file"')) - 1
    assert _first_delta_token(tok, hermes, "hermes") >= _first_delta_token(tok, glm, GLM47) + 6


def test_glm47_call_without_arguments_and_typed_values() -> None:
    tok = Tokenizer()
    out = parse_chat_output(tok, tok.encode("<tool_call>noop</tool_call>"), tool_format=GLM47)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("noop", "{}")] and out.content is None
    text = render_tool_call("f", json.dumps({"n": 3, "x": 1.5, "s": "two words", "o": {"k": [1]}, "q": '"x"'}), GLM47)
    call = parse_chat_output(tok, tok.encode(text), tool_format=GLM47).tool_calls[0]
    assert json.loads(call.arguments) == {"n": 3, "x": 1.5, "s": "two words", "o": {"k": [1]}, "q": '"x"'}
    # And the call re-renders to the very text (the round trip the guard relies on).
    assert render_tool_call(call.name, call.arguments, GLM47) == text


def test_glm47_cut_call_is_raw_content_non_streamed_and_never_streams_a_name_it_lacks() -> None:
    tok = Tokenizer()
    ids = tok.encode(render_tool_call("read_file", '{"path": "a"}', GLM47))
    before_name = ids[:3]  # <tool_call>read_ : the name is not complete
    out = parse_chat_output(tok, before_name, tool_format=GLM47)
    assert out.tool_calls == [] and out.content == "<tool_call>read_"
    parser = ChatOutputParser(tok, tool_format=GLM47)
    assert all(parser.push(t).empty() for t in before_name) and parser.finish().tool_calls == []
    mid_args = ids[:-3]  # inside the value: vLLM's non-streamed regex needs </tool_call>
    out = parse_chat_output(tok, mid_args, tool_format=GLM47)
    assert out.tool_calls == [] and out.content == "<tool_call>read_file<arg_key>path</arg_key><arg_value>"

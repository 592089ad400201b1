"""Kimi's chat format: the preset template renders the format; the output parser splits reasoning,
content and tool calls the same way whatever chunks the text arrives in."""
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from k3compile.runtime.server.chat_format import ChatFormat, OutputParser
from k3compile.tokenizer import ByteTokenizer

CALL = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
        '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.time:1<|tool_call_argument_begin|>{}'
        '<|tool_call_end|><|tool_calls_section_end|>')
TEXT = "<think>plan it</think>Sure." + CALL


def test_preset_template_renders_kimi_format():
    fmt = ChatFormat(ByteTokenizer())
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": "", "reasoning_content": "R",
             "tool_calls": [{"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
            {"role": "tool", "tool_call_id": "functions.f:0", "content": "T"}]
    text = fmt.render_text(msgs, tools, {"thinking": True})
    assert text.startswith('<|im_system|>tool_declare<|im_middle|>[{"type": "function"')
    assert "<|im_system|>system<|im_middle|>S<|im_end|><|im_user|>user<|im_middle|>U<|im_end|>" in text
    assert ("<|im_assistant|>assistant<|im_middle|><think>R</think><|tool_calls_section_begin|><|tool_call_begin|>"
            'functions.f:0<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|><|tool_calls_section_end|><|im_end|>') in text
    assert "<|im_system|>tool<|im_middle|>## Return of functions.f:0\nT<|im_end|>" in text
    assert text.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert fmt.render(msgs, tools, {}) == ByteTokenizer().encode(fmt.render_text(msgs, tools, {}))
    assert fmt.thinks({"thinking": True}) and not fmt.thinks({})


def test_whole_message():
    msg = OutputParser(thinking=False, tools=True).whole(TEXT)
    assert msg["reasoning_content"] == "plan it" and msg["content"] == "Sure."
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        [("functions.get_weather:0", "get_weather", {"city": "Paris"}), ("functions.time:1", "time", {})]
    assert OutputParser(thinking=True, tools=False).whole("abc</think>x") == {"content": "x", "reasoning_content": "abc"}
    assert OutputParser(thinking=False, tools=False).whole(CALL) == {"content": CALL}   # no tools: plain text
    assert OutputParser(thinking=False, tools=True).whole("a <think> b") == {"content": "a <think> b"}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, len(TEXT)), max_size=12))
def test_streamed_split_does_not_depend_on_chunking(cuts):
    p = OutputParser(thinking=False, tools=True)
    bounds = [0, *sorted(cuts), len(TEXT)]
    merged = {"reasoning_content": "", "content": "", "tool_calls": []}
    for a, b in zip(bounds, bounds[1:]):
        for k, v in p.feed(TEXT[a:b]).items():
            merged[k] += v
    for k, v in p.finish().items():
        merged[k] += v
    assert merged["reasoning_content"] == "plan it" and merged["content"] == "Sure."
    assert [c["index"] for c in merged["tool_calls"]] == [0, 1]
    assert merged["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'

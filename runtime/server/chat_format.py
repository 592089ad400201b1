"""Kimi's chat format: prompts rendered from a Jinja chat template, and the assistant's output split
back into reasoning, content and tool calls.

Rendering. A checkpoint's tokenizer brings its own template (tokenizer_config.json /
chat_template.jinja) and transformers' `apply_chat_template` renders it with the messages, the
tools and `chat_template_kwargs` (e.g. {"thinking": true}). Presets (byte tokenizer, no template)
use `PRESET_TEMPLATE` below, a small template in the same format, rendered by the same
transformers Jinja code, so every path is exercised on a laptop.

The format (Kimi K2 / K3):

    <|im_system|>tool_declare<|im_middle|>[tools as JSON]<|im_end|>
    <|im_user|>user<|im_middle|>Hi<|im_end|>
    <|im_assistant|>assistant<|im_middle|><think>reasoning</think>answer
    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>
    <|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n18C<|im_end|>

Parsing (OutputParser) works on text, streamed or whole: text before `</think>` is
`reasoning_content` (when the request thinks), the tool-call section becomes OpenAI `tool_calls`
(id = the call's `functions.NAME:IDX`, streamed as one delta per call once its arguments are
complete), everything else is `content`. In a checkpoint's tokenizer the markers are special
tokens, so the chat path decodes with special tokens kept (`decoder`), less bos/eos/pad.
"""
from __future__ import annotations

import json

from . import protocol as P

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
THINK_BEGIN, THINK_END = "<think>", "</think>"

PRESET_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}\n{{ m.content }}"
    "{%- else -%}<|im_{{ 'system' if m.role == 'developer' else m.role }}|>{{ m.name or m.role }}<|im_middle|>"
    "{%- if m.role == 'assistant' and m.reasoning_content -%}<think>{{ m.reasoning_content }}</think>{%- endif -%}"
    "{{ m.content }}"
    "{%- if m.tool_calls -%}<|tool_calls_section_begin|>"
    "{%- for c in m.tool_calls -%}<|tool_call_begin|>{{ c.id }}<|tool_call_argument_begin|>"
    "{{ c.function.arguments | tojson }}<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}"
    "{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking -%}<think>{%- endif -%}{%- endif -%}")


class _KeepMarkers:
    """Decodes with special tokens kept (the format's markers), bos/eos/pad dropped."""

    def __init__(self, tok):
        self.tok = tok
        inner = tok.tok
        self.drop = {t for t in (inner.bos_token_id, inner.eos_token_id, inner.pad_token_id) if t is not None}

    def decode(self, ids: list[int]) -> str:
        return self.tok.tok.decode([i for i in ids if i not in self.drop], skip_special_tokens=False)


class ChatFormat:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.template = template or PRESET_TEMPLATE
        self.own_template = template is not None
        self.decoder = _KeepMarkers(tokenizer) if hasattr(tokenizer, "tok") else tokenizer
        # markers that are one special token each are written as such in grammars (llguidance's <|...|>)
        self.special_markers = hasattr(tokenizer, "tok") and \
            tokenizer.tok.convert_tokens_to_ids(CALL_BEGIN) not in (None, tokenizer.tok.unk_token_id)

    def render_text(self, messages: list[dict], tools: list[dict] | None, kwargs: dict) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template
        try:
            rendered, _ = render_jinja_template(conversations=[messages], tools=tools or None,
                                                chat_template=self.template, add_generation_prompt=True, **kwargs)
        except Exception as e:   # jinja errors: the messages do not fit the template
            raise P.ApiError(400, f"the chat template cannot render these messages: {e}", param="messages") from None
        return rendered[0]

    def render(self, messages: list[dict], tools: list[dict] | None, kwargs: dict) -> list[int]:
        if self.own_template:
            try:
                return list(self.tok.tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                             tokenize=True, return_dict=False, **kwargs))
            except Exception as e:
                raise P.ApiError(400, f"the chat template cannot render these messages: {e}",
                                 param="messages") from None
        return self.tok.encode(self.render_text(messages, tools, kwargs))

    def thinks(self, kwargs: dict) -> bool:
        """Does the generation prompt open a <think> block (then output starts as reasoning)?"""
        return self.render_text([{"role": "user", "content": ""}], None, kwargs).endswith(THINK_BEGIN)

    def parser(self, req: "P.ChatRequest") -> "OutputParser":
        return OutputParser(thinking=self.thinks(req.chat_template_kwargs),
                            tools=bool(req.tools) and req.tool_choice != "none")

    def tool_guide(self, tools: list[dict], choice) -> tuple[str, str] | None:
        """tool_choice 'required' or a named function: a Lark grammar that forces one call (or
        several, for 'required') with arguments valid under the function's JSON schema."""
        if choice in ("none", "auto") or not tools:
            return None
        names = [choice["function"]["name"]] if isinstance(choice, dict) else [t["function"]["name"] for t in tools]
        lit = (lambda m: m) if self.special_markers else json.dumps
        rules = []
        for i, t in enumerate(tools):
            fn = t["function"]
            if fn["name"] in names:
                rules.append(f"call_{i}: {lit(CALL_BEGIN)} {json.dumps('functions.' + fn['name'] + ':')} /[0-9]/ "
                             f"{lit(ARG_BEGIN)} args_{i} {lit(CALL_END)}\nargs_{i}: %json {json.dumps(fn['parameters'])}")
        calls = " | ".join(r.split(":", 1)[0] for r in rules)
        many = "+" if not isinstance(choice, dict) else ""
        grammar = f"start: {lit(SECTION_BEGIN)} call{many} {lit(SECTION_END)}\ncall: {calls}\n" + "\n".join(rules)
        return ("lark", grammar)


class OutputParser:
    """Incremental split of assistant text into reasoning_content / content / tool_calls deltas."""

    def __init__(self, thinking: bool, tools: bool):
        self.in_think = thinking
        self.may_think = True          # a leading <think> opens reasoning even when not asked for
        self.tools = tools
        self.buf = ""                  # text not yet classified
        self.in_section = False
        self.calls: list[dict] = []    # complete calls, in order
        self.saw_calls = False

    def _markers(self) -> list[str]:
        if self.in_think:
            return [THINK_END]
        if self.in_section:
            return [CALL_END, SECTION_END]
        return ([THINK_BEGIN] if self.may_think else []) + ([SECTION_BEGIN] if self.tools else [])

    def feed(self, text: str, final: bool = False) -> dict:
        self.buf += text
        out: dict = {}
        while True:
            markers = self._markers()
            hits = [(self.buf.find(m), m) for m in markers if m and self.buf.find(m) >= 0]
            if not hits:
                break
            i, m = min(hits)
            self._emit(out, self.buf[:i], m)
            self.buf = self.buf[i + len(m):]
        if final:
            self._emit(out, self.buf, None)
            self.buf = ""
        elif not self.in_section:
            hold = max((k for m in self._markers() for k in range(1, len(m))
                        if self.buf.endswith(m[:k])), default=0)   # a marker may still be arriving
            self._emit(out, self.buf[:len(self.buf) - hold], None)
            self.buf = self.buf[len(self.buf) - hold:]
        return out

    def finish(self) -> dict:
        return self.feed("", final=True)

    def _emit(self, out: dict, text: str, marker: str | None) -> None:
        if self.in_think:
            if text:
                out["reasoning_content"] = out.get("reasoning_content", "") + text
            if marker == THINK_END:
                self.in_think = False
            return
        if self.in_section:
            if marker == CALL_END:
                self._call(out, text)
            elif marker == SECTION_END:
                self.in_section = False
            return   # text between calls, or an unfinished call, is not content
        if marker == THINK_BEGIN and not text.strip() and "content" not in out and not self.saw_calls:
            self.in_think, self.may_think = True, False
            return
        if text or (marker == THINK_BEGIN):
            out["content"] = out.get("content", "") + text + (marker if marker == THINK_BEGIN else "")
            self.may_think = False
        if marker == SECTION_BEGIN:
            self.in_section, self.saw_calls = True, True

    def _call(self, out: dict, text: str) -> None:
        head, _, args = text.partition(ARG_BEGIN)
        head = head.replace(CALL_BEGIN, "").strip()
        name = head.split(".", 1)[-1].rsplit(":", 1)[0]
        args = args.strip()
        try:
            args = json.dumps(json.loads(args), ensure_ascii=False)
        except ValueError:
            pass   # sent as generated: the client sees what the model wrote
        call = {"index": len(self.calls), "id": head, "type": "function",
                "function": {"name": name, "arguments": args}}
        self.calls.append(call)
        out.setdefault("tool_calls", []).append(call)

    def whole(self, text: str) -> dict:
        """The message of a finished, non-streamed choice."""
        d = self.feed(text, final=True)
        msg = {"content": d.get("content") if (d.get("content") or not self.calls) else None}
        if msg["content"] is None and not self.calls:
            msg["content"] = ""
        if "reasoning_content" in d:
            msg["reasoning_content"] = d["reasoning_content"]
        if self.calls:
            msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in self.calls]
        return msg

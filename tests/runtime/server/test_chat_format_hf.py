"""The checkpoint path of the chat format, on a tiny byte-level BPE tokenizer made here (the Kimi
markers as special tokens, the Kimi-format template in its tokenizer config): the template renders
through transformers' apply_chat_template, the decoder keeps the markers, the parser finds the
calls, and a forced tool call's grammar names the markers as special tokens for llguidance."""
import json

import pytest

from k3compile.runtime.server.chat_format import (ARG_BEGIN, CALL_BEGIN, CALL_END, PRESET_TEMPLATE, SECTION_BEGIN,
                                                   SECTION_END, ChatFormat)

MARKERS = [SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END, "<|im_system|>", "<|im_user|>",
           "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from k3compile.tokenizer import HFTokenizer
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = ['{"city": "Paris"} functions.get_weather:0 the weather is nice', "user assistant system tool"] * 20
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["[BOS]", "[EOS]", *MARKERS],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="[BOS]", eos_token="[EOS]",
                            chat_template=PRESET_TEMPLATE).save_pretrained(str(out))
    return HFTokenizer(str(out))


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"], "additionalProperties": False}}}]


def test_checkpoint_template_and_markers(hf_tok):
    fmt = ChatFormat(hf_tok)
    assert fmt.own_template and fmt.special_markers
    msgs = [{"role": "user", "content": "weather?"}]
    ids = fmt.render(msgs, TOOLS, {})
    assert ids == hf_tok.tok.encode(fmt.render_text(msgs, TOOLS, {}), add_special_tokens=False)
    assert hf_tok.tok.convert_tokens_to_ids("<|im_user|>") in ids   # markers are single special tokens
    call = (SECTION_BEGIN + CALL_BEGIN + "functions.get_weather:0" + ARG_BEGIN + '{"city": "Paris"}' + CALL_END +
            SECTION_END)
    out_ids = hf_tok.tok.encode(call, add_special_tokens=False) + [hf_tok.eos_token_id]
    assert hf_tok.decode(out_ids) != call   # the plain decode drops the markers...
    text = fmt.decoder.decode(out_ids)
    assert text == call                     # ...the chat decoder keeps them (and drops eos)
    from k3compile.runtime.server.chat_format import OutputParser
    msg = OutputParser(thinking=False, tools=True).whole(text)
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_forced_call_grammar_uses_special_tokens(hf_tok):
    from k3compile.runtime.structured_output import Guide, _ll_tokenizer, grammar_for
    fmt = ChatFormat(hf_tok)
    kind, spec = fmt.tool_guide(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    vocab = len(hf_tok.tok)
    m = Guide(_ll_tokenizer(hf_tok, vocab), grammar_for(kind, spec), vocab).matcher()
    call = (SECTION_BEGIN + CALL_BEGIN + "functions.get_weather:0" + ARG_BEGIN + '{"city":"Paris"}' + CALL_END +
            SECTION_END)
    for t in hf_tok.tok.encode(call, add_special_tokens=False):
        m.accept(t)   # raises if the grammar rejects a token
    assert m.is_terminated() or m.m.is_accepting()
    bad = Guide(_ll_tokenizer(hf_tok, vocab), grammar_for(kind, spec), vocab).matcher()
    with pytest.raises(RuntimeError):
        bad.accept(hf_tok.tok.convert_tokens_to_ids(CALL_BEGIN))   # the section must open first

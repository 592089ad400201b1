"""The small endpoints clients probe: /version, /tokenize, /detokenize (also under /v1/).

Shapes follow vLLM (SGLang accepts the same): POST /tokenize {"model", "prompt"} or {"model",
"messages", "add_generation_prompt"} -> {"tokens": [...], "count": n, "max_model_len": m};
POST /detokenize {"model", "tokens": [...]} -> {"prompt": text, "text": text} (vLLM's and SGLang's keys);
GET /version -> {"version"};
GET /tokenizer_info -> {"eos_token", "bos_token", "pad_token", "chat_template", "model_max_length"}
(what lm-evaluation-harness's remote tokenizer reads before it tokenizes through /tokenize).
"""
from __future__ import annotations

from fastapi import Depends, Request

from . import protocol as P


def add_token_routes(app, front, model_name: str, chat_format, check_auth, check_model) -> None:
    from .app import json_body

    @app.get("/version")
    async def version():
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as pkg_version
        try:
            v = pkg_version("k3compile")
        except PackageNotFoundError:
            v = "0+local"
        return {"version": v}

    @app.get("/tokenizer_info", dependencies=[Depends(check_auth)])
    async def tokenizer_info():
        tok = front.tokenizer

        def name(token_id):
            return None if token_id is None else tok.token_bytes(token_id).decode("utf-8", errors="replace")

        return {"eos_token": name(tok.eos_token_id), "bos_token": name(tok.bos_token_id),
                "pad_token": name(getattr(tok, "pad_token_id", None)), "chat_template": chat_format.template,
                "model_max_length": front.max_context, "tokenizer_class": type(tok).__name__}

    def body_of(raw) -> dict:
        if not isinstance(raw, dict):
            raise P.invalid(None, "the request body must be a JSON object", "invalid_type")
        if "model" in raw:
            if not isinstance(raw["model"], str):
                raise P.invalid("model", "'model' must be a string", "invalid_type")
            check_model(raw["model"])
        return raw

    async def tokenize(request: Request):
        body = body_of(await json_body(request))
        tok = front.tokenizer
        if "messages" in body:
            req = P.parse_chat({"model": model_name, "messages": body["messages"]})
            ids = chat_format.render(req.messages, None, body.get("chat_template_kwargs") or {})
        else:
            prompt = body.get("prompt", body.get("text"))
            if not isinstance(prompt, str):
                raise P.invalid("prompt", "'prompt' must be a string (or give 'messages')", "invalid_type")
            add_special = body.get("add_special_tokens", True)
            if not isinstance(add_special, bool):
                raise P.invalid("add_special_tokens", "'add_special_tokens' must be a boolean", "invalid_type")
            ids = tok.encode(prompt, add_bos=add_special)
        return {"tokens": ids, "count": len(ids), "max_model_len": front.max_context}

    async def detokenize(request: Request):
        body = body_of(await json_body(request))
        ids = body.get("tokens")
        vocab = front.config.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise P.invalid("tokens", "'tokens' must be a list of token ids", "invalid_type")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise P.invalid("tokens", f"token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
        text = front.tokenizer.decode(ids)
        return {"prompt": text, "text": text}   # vLLM's key, SGLang's key

    for path in ("/tokenize", "/v1/tokenize"):
        app.post(path, dependencies=[Depends(check_auth)])(tokenize)
    for path in ("/detokenize", "/v1/detokenize"):
        app.post(path, dependencies=[Depends(check_auth)])(detokenize)

"""The OpenAI-compatible HTTP server (FastAPI): routes, auth, errors, SSE framing.

    POST /v1/completions, /v1/chat/completions   streaming (SSE) or not
    POST /tokenize, /detokenize (+ /v1/...)     SGLang's / vLLM's shapes (runtime/server/token_routes.py)
    GET  /version, /v1/models, /v1/models/{id}
    GET  /health                                 200, or 503 naming why the engine is unusable
    GET  /metrics                                Prometheus text format

With an API key, /v1/* needs `Authorization: Bearer KEY` (401 otherwise); /health and /metrics
stay open for probes and scrapers. Every error is {"error": {message, type, param, code}} with a
4xx for the client's mistakes and 5xx for ours; one bad request never affects another.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3compile.runtime.sampling import SamplingParams

from . import protocol as P
from .async_engine import AsyncEngine, EngineError
from .chat_format import ChatFormat
from .choices import ChoiceView
from .edge import CatchAll, json_body
from .metrics import ServerMetrics
from .serving import Choice, Generation, collect, merged_deltas, start_generation
from .token_routes import add_token_routes

log = logging.getLogger("k3compile.server")

_COMPLETION_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions; chat runs to the context


def build_app(front: AsyncEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The app owns the front's lifetime: the engine thread starts and stops with the server."""
    if front.tokenizer is None:
        raise ValueError("the model has no tokenizer (no tokenizer files and no byte-level vocabulary); "
                         "the server needs one to turn text into tokens")
    metrics = ServerMetrics(front)
    front.on_latency = metrics.observe_latency
    created = P.now()

    @asynccontextmanager
    async def lifespan(app):
        front.start()
        yield
        front.shutdown()

    app = FastAPI(title="k3compile", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.front, app.state.metrics = front, metrics
    from .profiling import register as register_profiling   # POST /start_profile, /stop_profile
    app.state.profiler = register_profiling(app, front)
    app.add_middleware(CatchAll, on_status=lambda status: metrics.errors.labels(status=status).inc())

    # -- errors ---------------------------------------------------------------------------------

    @app.exception_handler(P.ApiError)
    async def api_error(request: Request, e: P.ApiError):
        metrics.errors.labels(status=str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        metrics.errors.labels(status=str(e.status_code)).inc()
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(P.ApiError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code)

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise P.ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key")

    # -- info -----------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        problem = front.health()
        if problem is not None:
            return JSONResponse({"status": "unhealthy", "error": problem}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "k3compile",
                "max_model_len": front.max_context}

    @app.get("/v1/models", dependencies=[Depends(check_auth)])
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(check_auth)])
    async def model(model_id: str):
        check_model(model_id, "model")
        return model_card()

    def check_model(name: str, param: str = "model") -> None:
        if name != model_name:
            raise P.ApiError(404, f"the model '{name}' does not exist; this server serves '{model_name}'",
                             param=param, code="model_not_found")

    # -- generation -----------------------------------------------------------------------------

    chat_format = ChatFormat(front.tokenizer)
    add_token_routes(app, front, model_name, chat_format, check_auth, check_model)

    @app.post("/v1/completions", dependencies=[Depends(check_auth)])
    async def completions(request: Request):
        req = P.parse_completion(await json_body(request))
        check_model(req.model)
        tok = front.tokenizer
        prompts = [tok.encode(p) if isinstance(p, str) else p for p in req.prompts]
        return await serve(request, req, prompts, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_auth)])
    async def chat_completions(request: Request):
        req = P.parse_chat(await json_body(request))
        check_model(req.model)
        ids = chat_format.render(req.messages, req.tools if req.tool_choice != "none" else None,
                                 req.chat_template_kwargs)
        tool_guide = chat_format.tool_guide(req.tools, req.tool_choice)
        if tool_guide is not None:
            if req.guide is not None:
                raise P.ApiError(400, "a forced tool call (tool_choice 'required' or a function) cannot be combined "
                                 "with response_format / guided_*", param="tool_choice")
            req.guide = tool_guide
        return await serve(request, req, [ids], chat=True)

    async def serve(request: Request, req: P.GenerationRequest, prompts: list[list[int]], chat: bool):
        samples = (getattr(req, "best_of", None) or req.n)
        params = [sampling_params(req, ids, default_max=None if chat else _COMPLETION_DEFAULT_MAX_TOKENS,
                                  rank=samples > req.n) for ids in prompts]
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        decoder = chat_format.decoder if chat else None
        gens: list[Generation] = []
        try:
            for k, (ids, prm) in enumerate(zip(prompts, params)):
                gens += await start_generation(front, rid if k == 0 else f"{rid}-p{k}", ids, prm, req.stop,
                                               n=samples, first_index=k * samples, decoder=decoder)
        except ValueError as e:   # the engine's own check (out-of-vocabulary ids, a bad grammar, ...)
            for g in gens:
                g.stream.abort()
            raise P.ApiError(400, str(e), param="messages" if chat else "prompt") from None
        except EngineError as e:
            for g in gens:
                g.stream.abort()
            raise P.ApiError(503, str(e), "server_error", code="engine_unavailable") from None
        stamp = P.now()
        view = ChoiceView(req, prompts, chat, front.tokenizer, chat_format)
        if req.stream:
            return StreamingResponse(sse_events(gens, req, rid, stamp, view), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await whole_response(request, gens, req, rid, stamp, view)

    def sampling_params(req: P.GenerationRequest, prompt_ids: list[int], default_max: int | None,
                        rank: bool) -> SamplingParams:
        prompt_len = len(prompt_ids)
        room = front.max_context - prompt_len
        if room < (0 if req.max_tokens == 0 else 1):
            raise P.ApiError(400, f"the prompt has {prompt_len} tokens; this model's maximum context length is "
                             f"{front.max_context} tokens, and at least one must be left to generate",
                             param="messages" if isinstance(req, P.ChatRequest) else "prompt",
                             code="context_length_exceeded")
        if req.max_tokens is not None and req.max_tokens > room:
            raise P.ApiError(400, f"this model's maximum context length is {front.max_context} tokens; the prompt "
                             f"has {prompt_len} and max_tokens asks for {req.max_tokens} more",
                             param="max_tokens", code="context_length_exceeded")
        vocab = front.config.vocab_size
        bad = [t for t, _ in req.logit_bias if t >= vocab]
        if bad:
            raise P.ApiError(400, f"logit_bias token id(s) {bad[:5]} outside the vocabulary [0, {vocab})",
                             param="logit_bias")
        max_tokens = req.max_tokens if req.max_tokens is not None else min(default_max or room, room)
        echo = getattr(req, "echo", False)
        prompt_logprobs = None
        if echo and req.logprobs is not None:
            prompt_logprobs = req.logprobs
        elif max_tokens == 0:
            prompt_logprobs = 0   # nothing to generate: the engine only scores the prompt
        logprobs = req.logprobs if req.logprobs is not None else (0 if rank else None)
        # the engine stops at the tokenizer's eos itself unless ignore_eos
        return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              max_new_tokens=max_tokens, seed=req.seed, ignore_eos=req.ignore_eos,
                              presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                              repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs, guide=req.guide)

    async def whole_response(request: Request, gens: list[Generation], req, rid: str, stamp: int, view):
        # a client that hangs up stops its generations, as a stream's does
        work = asyncio.ensure_future(collect(gens))
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()   # its finally aborts the engine requests
        if not work.done() or work.cancelled():
            return Response(status_code=499)   # nobody is listening
        try:
            results = work.result()
        except EngineError as e:
            raise P.ApiError(500, str(e), "server_error", code="engine_error") from None
        for c in results:
            metrics.requests.labels(finish_reason=str(c.last.finish_reason)).inc()
        usage = view.usage(results)
        chosen = view.best(results)
        return P.envelope(rid, "chat.completion" if view.chat else "text_completion", stamp, req.model,
                          [view.whole_choice(c) for c in chosen], usage)

    async def sse_events(gens: list[Generation], req, rid: str, stamp: int, view):
        obj = "chat.completion.chunk" if view.chat else "text_completion"
        usage_key = req.include_usage   # with include_usage every chunk carries "usage": null

        def event(choices: list[dict], usage_: dict | None = None) -> str:
            return sse(P.envelope(rid, obj, stamp, req.model, choices, usage_, with_usage_key=usage_key))

        if view.chat:
            for g in gens:
                yield event([P.chat_delta_choice({"role": "assistant", "content": ""}, None,
                                                 [] if req.return_token_ids else None, g.index)])
        results = {g.index: Choice(g.index) for g in gens}
        try:
            async for d in merged_deltas(gens):
                results[d.index].add(d)
                choice = view.delta_choice(d)
                if choice is not None:
                    yield event([choice])
        except EngineError as e:   # the status line is sent already: the error goes in the stream
            metrics.errors.labels(status="500").inc()
            yield sse(P.ApiError(500, str(e), "server_error", code="engine_error").body())
            yield "data: [DONE]\n\n"
            return
        finally:
            for g in gens:
                g.stream.abort()   # client gone (cancelled or closed mid-stream): free the requests now
        for c in results.values():
            metrics.requests.labels(finish_reason=str(c.last.finish_reason)).inc()
        if req.include_usage:
            yield event([], view.usage(list(results.values())))
        yield "data: [DONE]\n\n"

    return app


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

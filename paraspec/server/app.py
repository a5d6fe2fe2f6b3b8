"""The OpenAI-compatible HTTP API over one Engine (FastAPI), and `serve()`, which runs it with uvicorn.

    GET  /v1/models              the one served model
    POST /v1/completions         prompt: a string or token ids (raw text, no template)
    POST /v1/chat/completions    messages, through the tokenizer's chat template
    GET  /health                 200 when the engine and every worker are alive, else 503 saying why
    GET  /metrics                Prometheus text (metrics.py)

Responses follow the OpenAI wire format; each also carries `paraspec`: the request's speculation figures (strategy,
acceptance_rate, mean_accepted_length, ttft_s, tpot_ms, draft_s, verify_s, ...), in the last streamed chunk too, and
a speculative strategy's `usage` has `spec_decode` (drafts, accepted tokens, per draft position). Streamed logprobs:
each chunk carries those of the tokens whose text it carries. Streams are server-sent events (`data: {json}` ...
`data: [DONE]`); an error after the stream started is one `data: {"error": {...}}` event, as vLLM and OpenAI send
it. Up to the engine's max_num_seqs generations run at once, their forwards batched (queue.py, scheduler.py).

Choices: every choice (n per prompt; a list of prompts on /v1/completions) is a generation of its own in the queue,
so that they run batched; choice j of prompt p has index p * n + j, and with a seed s the seed s + j (mod 2**64), so
a seeded request repeats and a prompt in a list gets what it gets alone. Usage counts each prompt once and every
choice's tokens. A stream interleaves the choices' chunks, each tagged with its index, and ends with one [DONE]; a
client that leaves cancels every choice. With several choices each carries its own `paraspec` figures and the
response's are their sum (counts, seconds), their rates from the sums, the earliest ttft_s, the mean tpot_ms.

Tools (chat): the tools go to the chat template, the family's calls are parsed out of the text (tools.py) into
`message.tool_calls` with finish_reason "tool_calls"; streamed, text before a call is content as it comes and a
call is one `delta.tool_calls` entry once its block has closed and parsed. tool_choice "required" or a named
function constrains the answer to vLLM's JSON (a list of calls, the function's arguments), strict tools the
family's format (`ServedModel.tool_calls`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
import logging
import signal
import time
import uuid
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from paraspec.errors import RefusedParameter
from paraspec.prompts import encode_prompt
from paraspec.request_state import TokenLogprob
from paraspec.runtime.errors import WorkerError
from paraspec.sampling import SamplingParams
from paraspec.server.metrics import ServerMetrics
from paraspec.server.queue import GenerationQueue, Job, QueueFull, ShuttingDown
from paraspec.server.schemas import ChatCompletionRequest, CompletionRequest, UnsupportedParameter, error_body
from paraspec.server.tools import (
    Event,
    ForcedCallParser,
    ToolCallParser,
    fold,
    forced_call_schema,
    format_of,
    strict_grammar,
)
from paraspec.streams import GenerationResult

log = logging.getLogger("paraspec.server")
Parser = ToolCallParser | ForcedCallParser
Constraint = tuple[str, tuple[str, str]] | None  # (the request field asking for it, SamplingParams.structured)
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's and vLLM's default)
STATS = (
    "strategy",
    "acceptance_rate",
    "mean_accepted_length",
    "ttft_s",
    "tpot_ms",
    "ms_per_token",
    "tokens_per_s",
    "draft_s",
    "verify_s",
    "drafted",
    "accepted",
    "rounds",
    "rollbacks",
)


class APIError(Exception):
    """Answered as an OpenAI error body with this HTTP status."""

    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code=None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def create_app(
    engine, model_name: str, api_key: str | None = None, max_queue: int = 64, request_timeout: float | None = None
) -> FastAPI:
    app = FastAPI(title="paraspec", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(model_name, engine.strategy.name)
    queue = GenerationQueue(engine, metrics, max_queue, request_timeout)
    app.state.queue, app.state.metrics = queue, metrics
    served = ServedModel(engine, model_name, queue, metrics, api_key)
    app.middleware("http")(served.authorize_and_count)
    app.exception_handler(APIError)(api_error)
    app.exception_handler(RequestValidationError)(invalid_request)
    app.get("/health")(served.health)
    app.get("/metrics")(served.prometheus)
    app.get("/v1/models")(served.models)
    app.post("/v1/completions")(served.completions)
    app.post("/v1/chat/completions")(served.chat_completions)
    return app


async def api_error(request: Request, exc: APIError):
    return JSONResponse(exc.body(), status_code=exc.status)


async def invalid_request(request: Request, exc: RequestValidationError):
    message, param = describe_validation_error(exc.errors()[0])
    return JSONResponse(error_body(message, param=param), status_code=400)


class ServedModel:
    """The route handlers of one served model: they share its engine, generation queue, metrics, name and API
    key, so they are methods over that state; `create_app` only wires them to paths."""

    def __init__(self, engine, model_name: str, queue: GenerationQueue, metrics: ServerMetrics, api_key: str | None):
        self.engine, self.model_name, self.queue, self.metrics, self.api_key = (
            engine,
            model_name,
            queue,
            metrics,
            api_key,
        )
        self.created = int(time.time())

    async def authorize_and_count(self, request: Request, call_next):
        path = request.url.path
        if (
            self.api_key is not None
            and path.startswith("/v1/")
            and request.headers.get("authorization", "") != f"Bearer {self.api_key}"
        ):
            response = JSONResponse(
                error_body(
                    "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the --api-key the "
                    "server was started with",
                    code="invalid_api_key",
                ),
                status_code=401,
            )
        else:
            response = await call_next(request)
        if path.startswith("/v1/"):
            self.metrics.request(path, response.status_code)
        return response

    async def health(self):
        problem = self.queue.health()
        if problem is not None:
            return JSONResponse({"status": "unavailable", "reason": problem}, status_code=503)
        return {"status": "ok"}

    async def prometheus(self):
        self.metrics.engine(self.engine)
        return PlainTextResponse(self.metrics.render(), media_type=self.metrics.content_type)

    async def models(self):
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "paraspec",
                    "max_model_len": self.engine.max_context,
                }
            ],
        }

    async def completions(self, body: CompletionRequest, request: Request):
        originals = body.prompts()
        prompts = [encode(self.engine, prompt, "prompt") for prompt in originals]
        echoes = None
        if body.echo:  # the prompt as sent (token ids: their text)
            echoes = [
                p if isinstance(p, str) else self.engine.tokenizer.decode(ids) for p, ids in zip(originals, prompts)
            ]
        return await self.respond(body, request, prompts, chat=False, echoes=echoes)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        tools = body.template_tools()
        parser, constraint = self.tool_calls(body, tools) if tools is not None else (None, None)
        prompt_ids = encode(self.engine, [m.as_template_message() for m in body.messages], "messages", tools)
        return await self.respond(body, request, [prompt_ids], chat=True, tool_parser=parser, constraint=constraint)

    def tool_calls(self, body: ChatCompletionRequest, tools: list[dict]) -> tuple[Callable[[], Parser], Constraint]:
        """How a chat answer's calls are read, and what constrains them: a forced call (tool_choice "required" or
        a named function) is vLLM's JSON (tools.forced_call_schema, whatever the model's format); with strict
        tools the family's format is constrained (tools.strict_grammar); else the model writes freely."""
        names = frozenset(tool["function"]["name"] for tool in tools)
        limit = None if body.parallel_tool_calls else 1
        try:
            if body.forces_call():
                function = body.named_function()
                schema = forced_call_schema(tools, function, limit)
                constraint = ("tool_choice", ("json_schema", json.dumps(schema)))
                return functools.partial(ForcedCallParser, function, names, limit), constraint
            call_format = format_of(self.engine.tokenizer)
        except ValueError as e:
            raise APIError(400, str(e), param="tools") from None
        parser = functools.partial(ToolCallParser, call_format, limit, names)
        if not any(tool["function"].get("strict") for tool in tools):
            return parser, None
        return parser, ("tools", ("grammar", strict_grammar(call_format, tools)))

    async def respond(
        self,
        body,
        request: Request,
        prompts: list[list[int]],
        chat: bool,
        tool_parser: Callable[[], Parser] | None = None,
        echoes: list[str] | None = None,
        constraint: Constraint = None,
    ):
        """Queue every choice's generation, then stream them or answer once they have ended. `echoes`: each
        prompt's text, put before its choices' text (completions' echo); `constraint`: the structured output the
        tools ask for, with the request field that asks for it."""
        if body.model != self.model_name:
            raise APIError(
                400,
                f"model {body.model!r} is not served here; this server serves {self.model_name!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        n = body.choices_per_prompt()
        if len(prompts) * n > self.queue.capacity:
            raise APIError(
                400,
                f"the request asks for {len(prompts) * n} generations ({len(prompts)} prompt(s) x n={n}) but this "
                f"server holds at most {self.queue.capacity} at once, running and waiting (--max-num-seqs "
                f"{self.engine.max_num_seqs} + --max-queue {self.queue.max_queue}); split the request",
                param="n" if len(prompts) == 1 else "prompt",
            )
        events: asyncio.Queue = asyncio.Queue()  # the choices' events, tagged with their index
        jobs = []
        for p, prompt_ids in enumerate(prompts):
            params = sampling_params(self.engine, body, prompt_ids, chat, constraint)
            for j in range(n):
                jobs.append(Job(prompt_ids, choice_params(params, j), body.stream, index=p * n + j, events=events))
        try:
            await self.queue.start(jobs)
        except QueueFull:
            raise APIError(
                429,
                f"the server's queue is full ({self.queue.max_queue} places, {self.queue.waiting} taken; this request "
                f"needs {len(jobs)}, one per choice); retry later or start the server with a larger --max-queue",
                type="rate_limit_error",
                code="queue_full",
            ) from None
        except ShuttingDown:
            raise APIError(503, "the server is shutting down", type="server_error") from None
        ids = (f"chatcmpl-{uuid.uuid4().hex}" if chat else f"cmpl-{uuid.uuid4().hex}", int(time.time()))
        if body.stream:
            return EventStream(
                self.stream_events(jobs, body, ids, chat, tool_parser, echoes),
                on_close=lambda: cancel_all(jobs, "disconnect"),
            )
        await wait_for_end(jobs, request)
        failure = first_failure(jobs)
        if failure is not None:
            raise failure
        return self.whole_response(jobs, body, ids, chat, tool_parser, echoes)

    async def stream_events(self, jobs: list[Job], body, ids, chat: bool, tool_parser, echoes=None):
        """Each choice's chunks as they come, each with the logprobs of the tokens whose text it carries (tokens
        whose text is held back, by a tool parser too, ride on the choice's next chunk; the rest on its last)."""
        by_index = {job.index: job for job in jobs}
        parsers = {job.index: tool_parser() for job in jobs} if tool_parser is not None else {}
        calls_sent = dict.fromkeys(by_index, 0)
        logprobs = {job.index: ChunkLogprobs(self.engine.tokenizer, chat) for job in jobs}
        if chat:
            for job in jobs:
                yield sse(self.chunk(ids, job.index, {"role": "assistant", "content": ""}, None, chat))
        running = len(jobs)
        while running:
            index, kind, delta = await jobs[0].events.get()
            parser, scored = parsers.get(index), logprobs[index]
            if kind == "end":
                running -= 1
                failure = job_failure(by_index[index])
                if failure is not None:  # the request fails whole: its other choices stop
                    cancel_all(jobs, "cancelled")
                    yield sse(failure.body())
                    break
                result = result_of(by_index[index])
                first_logprobs = result.prompt_logprobs
                scored.add_rest(result.logprobs)
            else:
                first_logprobs = delta.prompt_logprobs
                scored.add(delta.logprobs)
            if echoes is not None and not scored.echoed:  # the prompt as sent, first: with its logprobs
                prompt = by_index[index].prompt_ids
                chunk = self.chunk(ids, index, echoes[index // body.choices_per_prompt()], None, chat)
                chunk["choices"][0]["logprobs"] = scored.prompt(prompt, first_logprobs)
                yield sse(chunk)
            if kind == "delta":
                pieces: list[Event] = parser.feed(delta.text) if parser is not None else [("content", delta.text)]
            else:
                pieces = parser.finish() if parser is not None else []
            for piece_kind, value in pieces:
                if piece_kind == "call":
                    value = {"tool_calls": [{"index": calls_sent[index], **value}]}
                    calls_sent[index] += 1
                elif not value:
                    continue
                elif chat:
                    value = {"content": value}
                chunk = self.chunk(ids, index, value, None, chat)
                chunk["choices"][0]["logprobs"] = scored.take()
                yield sse(chunk)
            if kind == "end":
                job = by_index[index]
                last = self.chunk(ids, index, {} if chat else "", finish_reason(result, calls_sent[index]), chat)
                last["choices"][0]["logprobs"] = scored.take()
                last["paraspec"] = extension([job])
                if body.return_token_ids:
                    last["choices"][0]["token_ids"] = result.token_ids
                yield sse(last)
        else:
            if body.stream_options is not None and body.stream_options.include_usage:
                yield sse(
                    {
                        **self.chunk(ids, 0, None, None, chat),
                        "choices": [],
                        "usage": usage(jobs, body.choices_per_prompt()),
                        "paraspec": extension(jobs),
                    }
                )
        yield "data: [DONE]\n\n"

    def chunk(self, ids, index: int, delta, reason, chat: bool) -> dict:
        if chat:
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": index, "text": delta, "logprobs": None, "finish_reason": reason}
        return {
            "id": ids[0],
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": ids[1],
            "model": self.model_name,
            "choices": [choice],
        }

    def whole_response(self, jobs: list[Job], body, ids, chat: bool, tool_parser, echoes=None) -> dict:
        choices = []
        n = body.choices_per_prompt()
        for job in jobs:
            result = result_of(job)
            logprobs = logprobs_of(self.engine.tokenizer, result, chat, echoes is not None)
            if chat:
                message: dict = {"role": "assistant", "content": result.text}
                calls: list[dict] = []
                if tool_parser is not None:
                    parser = tool_parser()
                    message["content"], calls = fold(parser.feed(result.text) + parser.finish())
                    if calls:
                        message["tool_calls"] = calls
                choice = {
                    "index": job.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason(result, len(calls)),
                }
            else:
                choice = {
                    "index": job.index,
                    "text": (echoes[job.index // n] if echoes is not None else "") + result.text,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason(result),
                }
            if body.return_token_ids:
                choice["token_ids"] = result.token_ids
            if len(jobs) > 1:
                choice["paraspec"] = extension([job])
            choices.append(choice)
        return {
            "id": ids[0],
            "object": "chat.completion" if chat else "text_completion",
            "created": ids[1],
            "model": self.model_name,
            "choices": choices,
            "usage": usage(jobs, body.choices_per_prompt()),
            "paraspec": extension(jobs),
        }


async def wait_for_end(jobs: list[Job], request: Request) -> None:
    """Wait for the end of a non-streamed request's jobs, polling the connection so that a client that leaves
    cancels their generations (and so does this coroutine being cancelled). A job that fails stops the others: the
    request fails whole."""
    running = {job.index: job for job in jobs}
    try:
        while running:
            try:
                index, kind, _ = await asyncio.wait_for(jobs[0].events.get(), 0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    cancel_all(jobs, "disconnect")
                continue
            if kind == "end" and job_failure(running.pop(index)) is not None:
                cancel_all(jobs, "cancelled")
    finally:
        if running:
            cancel_all(jobs, "disconnect")


def cancel_all(jobs: list[Job], reason: str) -> None:
    for job in jobs:
        job.cancel(reason)


def choice_params(params: SamplingParams, choice: int) -> SamplingParams:
    """Choice j of a prompt samples with seed + j (mod 2**64): a seeded request repeats, its choices differ."""
    if params.seed is None or choice == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + choice) % 2**64)


class EventStream(StreamingResponse):
    """Server-sent events whose end, for any reason (sent, client gone, server stopping), calls on_close."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def logprobs_of(tokenizer, result: GenerationResult, chat: bool, echo: bool) -> dict | None:
    """The choice's `logprobs` in OpenAI's form: chat's `content` list, or completions' parallel lists (the
    prompt's tokens first with echo, the first of them without a logprob)."""
    if result.logprobs is None:
        return None
    if chat:
        return chat_logprobs(tokenizer, result.logprobs)
    scored: list[tuple[int, TokenLogprob | None]] = [(t.token, t) for t in result.logprobs]
    if echo and result.prompt_logprobs is not None:
        scored = list(zip(result.prompt_ids, result.prompt_logprobs)) + scored
    return completion_logprobs(tokenizer, scored)[0]


def chat_logprobs(tokenizer, logprobs: list[TokenLogprob]) -> dict:
    text = functools.partial(token_text, tokenizer)
    return {
        "content": [
            {**chat_entry(text, t.token, t.logprob), "top_logprobs": [chat_entry(text, *a) for a in t.top]}
            for t in logprobs
        ]
    }


def completion_logprobs(tokenizer, scored: list[tuple[int, TokenLogprob | None]], offset: int = 0) -> tuple[dict, int]:
    """Completions' parallel lists for (token, its TokenLogprob or None) pairs whose text starts at `offset` in the
    choice's text, and the offset after them."""
    text = functools.partial(token_text, tokenizer)
    tokens = [text(token) for token, _ in scored]
    offsets = list(itertools.accumulate((len(t) for t in tokens), initial=offset))
    lists = {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else lp.logprob for _, lp in scored],
        "top_logprobs": [None if lp is None else {text(a): v for a, v in lp.top} for _, lp in scored],
        "text_offset": offsets[:-1],
    }
    return lists, offsets[-1]


class ChunkLogprobs:
    """One streamed choice's logprobs, handed out chunk by chunk: those of the tokens since the last chunk that
    carried some (take), in OpenAI's form; completions' text offsets run on across chunks, as in the whole answer."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self.pending: list[TokenLogprob] = []
        self.received = 0  # how many the deltas carried
        self.offset = 0
        self.echoed = False

    def add(self, logprobs: list[TokenLogprob] | None) -> None:
        if logprobs is not None:
            self.pending += logprobs
            self.received += len(logprobs)

    def add_rest(self, logprobs: list[TokenLogprob] | None) -> None:
        """The result's: those no delta carried."""
        if logprobs is not None:
            self.add(logprobs[self.received :])

    def take(self) -> dict | None:
        if not self.pending:
            return None
        taken, self.pending = self.pending, []
        if self.chat:
            return chat_logprobs(self.tokenizer, taken)
        lists, self.offset = completion_logprobs(self.tokenizer, [(t.token, t) for t in taken], self.offset)
        return lists

    def prompt(self, prompt_ids: list[int], prompt_logprobs: list[TokenLogprob | None] | None) -> dict | None:
        """The echoed prompt's logprobs (completions), once: the first chunk's."""
        self.echoed = True
        if prompt_logprobs is None:
            return None
        lists, self.offset = completion_logprobs(self.tokenizer, list(zip(prompt_ids, prompt_logprobs)))
        return lists


def token_text(tokenizer, token: int) -> str:
    """One token's text as logprobs list it (its id as text where the checkpoint has no tokenizer)."""
    return tokenizer.decode([token]) if tokenizer is not None else str(token)


def chat_entry(text, token: int, logprob: float) -> dict:
    decoded = text(token)
    return {"token": decoded, "logprob": logprob, "bytes": list(decoded.encode())}


def encode(engine, prompt, param: str, tools: list[dict] | None = None) -> list[int]:
    try:
        if tools is None:
            return engine.encode(prompt)
        return encode_prompt(prompt, engine.tokenizer, engine.target.vocab_size, engine.max_context, tools)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None


# SamplingParams' names where the request's differ
REQUEST_NAMES = {"structured": "response_format", "prompt_logprobs": "echo"}


def sampling_params(engine, body, prompt_ids: list[int], chat: bool, constraint: Constraint = None) -> SamplingParams:
    """The request's SamplingParams, checked against the Engine (a strategy that does not apply a bias, logprobs or
    a structured output refuses here, before anything queues). `constraint`: the structured output the tools ask for
    (app.tool_calls), with the field that asks for it."""
    limit = body.new_token_limit()
    if limit is None:  # chat: until the context is full; completions: OpenAI's 16
        limit = max(1, engine.max_context - len(prompt_ids)) if chat else DEFAULT_COMPLETION_TOKENS
    names = dict(REQUEST_NAMES)
    try:
        structured = body.structured()
        if constraint is not None:
            field, tool_structured = constraint
            if structured is not None:
                raise UnsupportedParameter(
                    field,
                    f"'{field}' constrains the answer to tool calls and the request asks for another structured output "
                    f"too (response_format or guided_*); keep one",
                )
            structured, names["structured"] = tool_structured, field
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(0, body.top_k or 0),
            max_new_tokens=limit,
            seed=body.seed,
            stop_token_ids=body.stop_ids() or None,
            stop=body.stop_strings() or None,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            min_p=body.min_p or 0.0,
            logit_bias=body.bias(),
            logprobs=body.logprobs_count(),
            prompt_logprobs=body.prompt_logprobs_count(),
            structured=structured,
        )
        engine.check_params(params)
    except RefusedParameter as e:  # the request's name for what the strategy cannot honour
        param = names.get(e.param, e.param)
        message = str(e)
        if e.param == "structured" and constraint is not None:
            message = f"'{param}' is served by constraining the answer (a structured output): {e}"
        raise APIError(400, message, param=param) from None
    except UnsupportedParameter as e:
        raise APIError(400, str(e), param=e.param) from None
    except ValueError as e:
        first = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=names.get(first, first)) from None
    return params


def finish_reason(result, tool_calls: int = 0) -> str:
    if tool_calls:
        return "tool_calls"
    return "stop" if result.finish_reason == "stop" else "length"


def job_failure(job: Job) -> APIError | None:
    """The error a job ended with (as its HTTP status and OpenAI body), or None when it has a result."""
    if job.error is not None:
        e = job.error
        kind = "worker fault" if isinstance(e, WorkerError) else type(e).__name__
        return APIError(500, f"{kind}: {e}", type="server_error", code=500)
    if job.reason == "timeout":
        return APIError(
            504,
            f"the generation ran longer than the server's --request-timeout and was stopped "
            f"after {len(job.result.token_ids) if job.result is not None else 0} tokens; ask for fewer tokens "
            f"(max_tokens)",
            type="timeout_error",
            code=504,
        )
    if job.reason == "shutdown":
        return APIError(503, "the server is shutting down; the generation was stopped", type="server_error", code=503)
    if job.result is None or job.result.finish_reason == "cancelled":
        return APIError(499, "the request was cancelled", type="cancelled", code=499)
    return None


def first_failure(jobs: list[Job]) -> APIError | None:
    """The error a request fails with: its first choice's that failed of itself, not for a sibling (499)."""
    failures = [f for f in map(job_failure, jobs) if f is not None]
    return min(failures, key=lambda f: f.status == 499) if failures else None


def result_of(job: Job) -> GenerationResult:
    """The result of a job that job_failure() passed: it has one."""
    assert job.result is not None
    return job.result


def usage(jobs: list[Job], n: int) -> dict:
    """Each prompt's tokens once (choice 0 of each prompt), every choice's new tokens: as vLLM counts them. A
    speculative strategy adds the request's acceptance, every choice's together, under `spec_decode` (the names of
    vLLM's spec_decode metrics)."""
    prompt = sum(len(job.prompt_ids) for job in jobs if job.index % n == 0)
    completion = sum(len(result_of(job).token_ids) for job in jobs)
    counted: dict = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    stats = [result_of(job).stats for job in jobs]
    if all(s.acceptance_rate is None for s in stats):
        return counted
    drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
    per_position = [
        sum(column) for column in itertools.zip_longest(*(s.accepted_per_position for s in stats), fillvalue=0)
    ]
    counted["spec_decode"] = {
        "num_drafts": sum(s.rounds for s in stats),
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": per_position,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
    }
    return counted


SUMMED = ("drafted", "accepted", "rounds", "rollbacks", "draft_s", "verify_s", "tokens_per_s")


def extension(jobs: list[Job]) -> dict:
    """The paraspec figures of one choice, or of a request's choices together: counts and seconds summed, the rates
    from the sums, the earliest first token, the mean time per token, the longest wait in the queue."""
    each = [result_of(job).stats.to_dict() for job in jobs]
    if len(each) == 1:
        return {**{name: each[0][name] for name in STATS}, "queue_s": jobs[0].queue_s}
    total = {name: sum(s[name] for s in each) for name in SUMMED}
    speculative = any(s["acceptance_rate"] is not None for s in each)
    verified = sum((s["mean_accepted_length"] or 0.0) * s["rounds"] for s in each)
    together = {
        **total,
        "strategy": each[0]["strategy"],
        "acceptance_rate": (total["accepted"] / total["drafted"] if total["drafted"] else 0.0) if speculative else None,
        "mean_accepted_length": (verified / total["rounds"] if total["rounds"] else 0.0) if speculative else None,
        "ttft_s": min(s["ttft_s"] for s in each),
        "tpot_ms": sum(s["tpot_ms"] for s in each) / len(each),
        "ms_per_token": sum(s["ms_per_token"] for s in each) / len(each),
    }
    return {**{name: together[name] for name in STATS}, "queue_s": max(job.queue_s for job in jobs)}


def describe_validation_error(error: dict) -> tuple[str, str | None]:
    """One pydantic error as (message naming the field and the fix, the OpenAI `param`)."""
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, UnsupportedParameter):
        return str(cause), cause.param
    if error["type"] == "json_invalid":
        return (
            f"the request body is not valid JSON ({(error.get('ctx') or {}).get('error', 'parse error')}); "
            f"send a JSON object with Content-Type: application/json"
        ), None
    path = []
    for part in error["loc"][1:]:  # loc starts with "body"; union branches add type names: stop there
        if isinstance(part, int):
            path.append(f"[{part}]")
        elif "[" in part or part in ("str", "int", "float", "bool", "list", "dict"):
            break
        else:
            path.append(("." if path else "") + part)
    param = "".join(path) or None
    if param is None:
        return "the request body must be a JSON object with the request's parameters", None
    if error["type"] == "missing":
        return f"'{param}' is required", param
    message = error["msg"].removeprefix("Value error, ")
    return f"invalid '{param}': {message} (got {json.dumps(error.get('input'), default=str)[:80]})", param


def serve(
    engine,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str = "paraspec",
    api_key: str | None = None,
    max_queue: int = 64,
    request_timeout: float | None = None,
    log_level: str = "warning",
) -> int:
    """Serve `engine` until SIGINT/SIGTERM: then refuse new requests, end the running one with an error, and
    return 0 (the caller closes the Engine: workers stopped, segments unlinked). Prints the URL when ready
    (port 0: a free port, the printed one)."""
    app = create_app(engine, model_name, api_key, max_queue, request_timeout)
    server = _Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            timeout_graceful_shutdown=10,
            access_log=log_level in ("info", "debug", "trace"),
        ),
        app.state.queue,
        f"{engine.strategy.name} serving {model_name!r}",
    )
    server.run()
    return 0 if server.started else 1


class _Server(uvicorn.Server):
    """uvicorn's server that also ends the running generation on a signal, and does not re-raise the signal
    after shutting down (uvicorn does, so that a caller's handler runs): the command exits 0."""

    def __init__(self, config, queue: GenerationQueue, what: str):
        super().__init__(config)
        self._queue, self._what, self._loop = queue, what, None

    async def startup(self, sockets=None):
        await super().startup(sockets)
        self._loop = asyncio.get_running_loop()
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"paraspec serve: {self._what} at http://{host}:{port}/v1", flush=True)

    def handle_exit(self, sig, frame):
        if self._loop is not None and not self.should_exit:
            self._loop.call_soon_threadsafe(self._queue.shutdown)
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

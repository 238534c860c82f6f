"""POST /v1/chat/completions: build the engine requests, gather or stream the choices."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from sse_starlette import EventSourceResponse

from engine.protocol import PromptMessage, TokenLogprob
from server.errors import invalid_request
from server.protocol import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionTokenLogprob,
    ChoiceDelta,
    ChoiceLogprobs,
    TopLogprob,
)
from server.serving.answer import answer_choices
from server.serving.checks import (
    adapter_of,
    check_max_tokens,
    check_model,
    check_n,
    sampling_params,
)
from server.serving.choices import (
    ChoiceRequest,
    ChoiceStreams,
    UsageCounter,
    fan_out,
    gather_choices,
    new_id,
    prepare_jobs,
)
from server.serving.context import ServingContext
from server.serving.tool_formats import syntax_of
from server.serving.tools import ToolPlan, ToolStream, parse_calls, plan_tools, render_messages


def chat_logprobs(logprobs: list[TokenLogprob] | None) -> ChoiceLogprobs | None:
    if logprobs is None:
        return None
    return ChoiceLogprobs(
        content=[
            ChatCompletionTokenLogprob(
                token=lp.token,
                logprob=lp.logprob,
                bytes=lp.bytes,
                top_logprobs=[
                    TopLogprob(token=t.token, logprob=t.logprob, bytes=t.bytes)
                    for t in lp.top_logprobs
                ],
            )
            for lp in logprobs
        ]
    )


def _check_unsupported(request: ChatCompletionRequest) -> None:
    if request.logit_bias:
        raise invalid_request("logit_bias is not supported.", param="logit_bias")


def chat_jobs(
    ctx: ServingContext, request: ChatCompletionRequest, chat_id: str, tools: ToolPlan | None
) -> list[ChoiceRequest]:
    settings = ctx.settings
    _check_unsupported(request)
    n = check_n(settings, request.n)
    if request.max_completion_tokens is not None:
        max_tokens = check_max_tokens(
            settings, request.max_completion_tokens, "max_completion_tokens"
        )
    else:
        max_tokens = check_max_tokens(settings, request.max_tokens, "max_tokens")
    top_logprobs = request.top_logprobs or 0
    if top_logprobs and not request.logprobs:
        raise invalid_request("top_logprobs requires logprobs to be true.", param="top_logprobs")
    if top_logprobs > settings.max_top_logprobs:
        raise invalid_request(
            f"top_logprobs must be at most {settings.max_top_logprobs}.", param="top_logprobs"
        )
    sampling = sampling_params(
        settings,
        request,
        max_tokens=max_tokens,
        logprobs=bool(request.logprobs),
        top_logprobs=top_logprobs,
    )
    if tools is not None and tools.grammar is not None:
        sampling = dataclasses.replace(sampling, response_format=tools.grammar)
    syntax = syntax_of(ctx.engine.model.tool_format)
    messages: list[PromptMessage] = list(render_messages(request.messages, tools, syntax))
    return fan_out(chat_id, [messages], n, sampling, adapter_of(ctx.engine, request.model))


async def create_chat_completion(
    ctx: ServingContext, request: ChatCompletionRequest, raw_request: Request, tenant: str
) -> ChatCompletion | EventSourceResponse:
    model = check_model(ctx.engine, request.model)
    chat_id = new_id("chatcmpl")
    tools = plan_tools(ctx.settings, request, ctx.engine.model.tool_format)
    jobs = chat_jobs(ctx, request, chat_id, tools)
    if request.session_id and len(jobs) > 1:
        raise invalid_request(
            "n must be 1 with session_id: a session holds one conversation, and each answer "
            "joins its memory.",
            param="n",
        )
    jobs = await prepare_jobs(ctx, raw_request, tenant, jobs, ["messages"])
    return await answer_choices(
        ctx,
        request,
        raw_request,
        tenant,
        jobs,
        lambda s: chat_gather(s, chat_id, model, tools),
        lambda s, include_usage: _stream_chunks(s, chat_id, model, include_usage, tools),
    )


async def chat_gather(
    streams: ChoiceStreams, chat_id: str, model: str, tools: ToolPlan | None
) -> ChatCompletion:
    gathered, usage = await gather_choices(streams)
    choices = []
    for i in sorted(gathered):
        text, finish = gathered[i].text, gathered[i].finish_reason
        calls = None
        if tools is not None and tools.mode != "none":
            calls = parse_calls(text, tools.syntax)
        message = ChatCompletionMessage(content=text)
        if calls is not None:
            message, finish = ChatCompletionMessage(content=None, tool_calls=calls), "tool_calls"
        choices.append(
            ChatCompletionChoice(
                index=i,
                message=message,
                logprobs=chat_logprobs(gathered[i].logprobs),
                finish_reason=finish,
            )
        )
    return ChatCompletion(id=chat_id, model=model, choices=choices, usage=usage)


async def _stream_chunks(
    streams: ChoiceStreams,
    chat_id: str,
    model: str,
    include_usage: bool,
    tools: ToolPlan | None,
) -> AsyncIterator[str]:
    jobs = {job.index: job for job in streams.jobs}
    held = {i: ToolStream(tools) for i in jobs} if tools is not None else {}
    usage = UsageCounter()
    created = int(time.time())

    def chunk(
        index: int,
        delta: ChoiceDelta,
        delta_logprobs: ChoiceLogprobs | None,
        finish_reason: str | None,
    ) -> str:
        # Serialized with exclude_unset: what is not set here (role, usage) stays off the wire.
        fields: dict[str, Any] = {
            "id": chat_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [
                ChatCompletionChunkChoice(
                    index=index, delta=delta, logprobs=delta_logprobs, finish_reason=finish_reason
                )
            ],
        }
        if include_usage:
            fields["usage"] = None
        return ChatCompletionChunk(**fields).model_dump_json(exclude_unset=True)

    for index in sorted(jobs):
        yield chunk(index, ChoiceDelta(role="assistant", content=""), None, None)
    async for index, delta in streams:
        usage.add(jobs[index], delta)
        text = held[index].feed(delta.text) if index in held else delta.text
        if text or (delta.logprobs and index not in held):
            yield chunk(index, ChoiceDelta(content=text), chat_logprobs(delta.logprobs), None)
        if delta.finish_reason is None:
            continue
        finish: str = delta.finish_reason
        if index in held:  # the end of a held call (or of text that only looked like one)
            text, calls = held[index].finish()
            if text:
                yield chunk(index, ChoiceDelta(content=text), None, None)
            if calls:
                yield chunk(index, ChoiceDelta(tool_calls=calls), None, None)
                finish = "tool_calls"
        yield chunk(index, ChoiceDelta(), None, finish)
    if include_usage:
        final = ChatCompletionChunk(
            id=chat_id, created=created, model=model, choices=[], usage=usage.usage()
        )
        yield final.model_dump_json()

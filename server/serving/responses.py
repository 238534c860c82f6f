"""POST /v1/responses (OpenAI's Responses API) on top of chat: input items become chat
messages, the answer becomes output items, and stored responses chain by previous_response_id.

A response is answered as the chat request it amounts to (the same tools, structured outputs,
memory for long inputs and prefix reuse). With `store` (the default) its conversation is kept
in this replica's memory, per tenant (an LRU of `max_stored_responses`); a later response
naming it as `previous_response_id` continues that conversation without the client resending
it, and a long document in it is not read again: the prompt starts with the same tokens, so
the prefix cache (engine/caches/prefix_cache.py) starts from the memory that read it. `instructions`
are the first (system) message of each request and are not carried over, as OpenAI documents.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from pydantic import ValidationError
from sse_starlette import EventSourceResponse

from server.errors import APIError, invalid_request
from server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    ResponseCreateRequest,
    ToolCall,
    UsageInfo,
)
from server.serving.answer import answer_choices
from server.serving.chat import chat_gather, chat_jobs
from server.serving.checks import check_model
from server.serving.choices import ChoiceStreams, UsageCounter, prepare_jobs
from server.serving.context import ServingContext
from server.serving.response_store import StoredResponse, encoded_size
from server.serving.tools import ToolStream, plan_tools


async def create_response(
    ctx: ServingContext, body: ResponseCreateRequest, raw_request: Request, tenant: str
) -> dict[str, Any] | EventSourceResponse:
    model = check_model(ctx.engine, body.model)
    history: list[ChatMessage] = []
    if body.previous_response_id:
        try:
            previous = await ctx.responses.get(tenant, body.previous_response_id)
            history = list(previous.messages)
        except APIError as e:
            e.param = "previous_response_id"
            raise
    new = input_messages(body.input)
    system = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    chat = chat_request(body, [*system, *history, *new])
    response_id = f"resp_{secrets.token_hex(16)}"
    tools = plan_tools(ctx.settings, chat, ctx.engine.model.tool_format)
    jobs = chat_jobs(ctx, chat, response_id, tools)
    jobs = await prepare_jobs(ctx, raw_request, tenant, jobs, ["input"])
    if body.store is not False:
        conversation = {"messages": [m.model_dump() for m in [*history, *new]]}
        await ctx.responses.check_room(tenant, encoded_size(conversation))
    base = response_base(body, response_id, model)

    async def keep(done: dict[str, Any], answer: ChatMessage) -> None:
        if body.store is not False:
            await ctx.responses.put(tenant, StoredResponse(done, [*history, *new, answer]))

    async def gather(streams: ChoiceStreams) -> dict[str, Any]:
        completion = await chat_gather(streams, response_id, model, tools)
        choice = completion.choices[0]
        output, answer = answer_of(choice.message.content or "", choice.message.tool_calls)
        done = completed(base, output, choice.finish_reason, completion.usage)
        await keep(done, answer)
        return done

    def stream(streams: ChoiceStreams, _: bool) -> AsyncIterator[Any]:
        return stream_events(streams, base, tools, keep)

    return await answer_choices(ctx, chat, raw_request, tenant, jobs, gather, stream)


def chat_request(body: ResponseCreateRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request a response amounts to (validated as one, 400s naming its fields)."""
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": [m.model_dump(exclude_none=True) for m in messages],
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "parallel_tool_calls": body.parallel_tool_calls,
        "memory": body.memory.model_dump() if body.memory else None,
    }
    if body.tools is not None:
        fields["tools"] = [_chat_tool(i, t) for i, t in enumerate(body.tools)]
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}
    fields["tool_choice"] = choice
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name or "response", "schema": fmt.json_schema, "strict": fmt.strict}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None:
        fields["response_format"] = {"type": fmt.type}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        raise invalid_request(first["msg"], param=".".join(map(str, first["loc"]))) from None


def _chat_tool(index: int, tool: Any) -> Any:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise invalid_request(f"tools[{index}]: only function tools are served.", param="tools")
    keys = ("name", "description", "parameters", "strict")
    return {"type": "function", "function": {k: tool[k] for k in keys if k in tool}}


def input_messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """The chat messages of a response's input: text, message items, function calls (merged
    into one assistant message) and their outputs (tool messages)."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    messages: list[ChatMessage] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid_request(f"input[{i}]: unknown role {role!r}.", param="input")
            messages.append(ChatMessage(role=role, content=_item_text(i, item.get("content"))))
        elif kind == "function_call":
            call = ToolCall(
                id=str(item.get("call_id")),
                function=FunctionCall(
                    name=str(item.get("name")), arguments=str(item.get("arguments", "{}"))
                ),
            )
            last = messages[-1] if messages else None
            if (
                last is not None
                and last.role == "assistant"
                and last.tool_calls
                and not last.content
            ):
                last.tool_calls.append(call)
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _item_text(i, output)
            messages.append(
                ChatMessage(role="tool", tool_call_id=item.get("call_id"), content=text)
            )
        else:
            raise invalid_request(f"input[{i}]: items of type {kind!r} are not served.", "input")
    if not messages:
        raise invalid_request("input is empty.", param="input")
    return messages


def _item_text(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_request(f"input[{index}].content must be text or parts.", param="input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in (
            "input_text",
            "output_text",
            "text",
        ):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid_request(f"input[{index}]: {kind} parts are not served.", param="input")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def response_base(body: ResponseCreateRequest, response_id: str, model: str) -> dict[str, Any]:
    """The response object before its output: what the request asked for."""
    fmt = (
        body.text.format.model_dump(by_alias=True, exclude_none=True)
        if body.text and body.text.format
        else {"type": "text"}
    )
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "previous_response_id": body.previous_response_id,
        "store": body.store is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
        "tools": body.tools or [],
        "text": {"format": fmt},
        "metadata": body.metadata or {},
        "usage": None,
    }


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": f"msg_{secrets.token_hex(12)}",
        "status": status,
        "role": "assistant",
        "content": content if status == "completed" else [],
    }


def call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{secrets.token_hex(12)}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def usage_of(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def answer_of(text: str, calls: list[ToolCall] | None) -> tuple[list[dict[str, Any]], ChatMessage]:
    """The output items of an answer (its function calls, or its message) and the assistant
    message it adds to the conversation."""
    if calls:
        output = [call_item(c.id, c.function.name, c.function.arguments) for c in calls]
        return output, ChatMessage(role="assistant", tool_calls=calls)
    return [message_item(text)], ChatMessage(role="assistant", content=text)


def completed(
    base: dict[str, Any], output: list[dict[str, Any]], finish_reason: str | None, usage: UsageInfo
) -> dict[str, Any]:
    """The finished response object."""
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {
        **base,
        "output": output,
        "usage": usage_of(usage.prompt_tokens, cached, usage.completion_tokens),
        **_status(finish_reason),
    }


def _status(finish_reason: str | None) -> dict[str, Any]:
    if finish_reason == "length":
        return {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    return {"status": "completed", "incomplete_details": None}


async def stream_events(
    streams: ChoiceStreams, base: dict[str, Any], tools: Any, keep: Any
) -> AsyncIterator[dict[str, str]]:
    """The Responses API's typed events for one answer: created, the message's text deltas
    (or, at the end, each function call), then completed (or incomplete)."""
    sequence = 0

    def event(kind: str, **fields: Any) -> dict[str, str]:
        nonlocal sequence
        sequence += 1
        data = {"type": kind, "sequence_number": sequence - 1, **fields}
        return {"event": kind, "data": json.dumps(data)}

    [job] = streams.jobs
    usage = UsageCounter()
    held = ToolStream(tools) if tools is not None else None
    item: dict[str, Any] | None = None  # the message item, once text started
    text: list[str] = []
    finish_reason = None
    yield event("response.created", response=base)
    yield event("response.in_progress", response=base)
    async for _, delta in streams:
        usage.add(job, delta)
        piece = held.feed(delta.text) if held is not None else delta.text
        if delta.finish_reason is not None:
            finish_reason = delta.finish_reason
            if held is not None:
                piece += held.finish()[0]
        if not piece:
            continue
        if item is None:
            item = message_item("", status="in_progress")
            yield event("response.output_item.added", output_index=0, item=item)
            yield event("response.content_part.added", **_at(item), part=_part(""))
        text.append(piece)
        yield event("response.output_text.delta", **_at(item), delta=piece, logprobs=[])
    full = "".join(text)
    output, answer = answer_of(full, held.calls if held is not None else None)
    for index, done_item in enumerate(output):
        if done_item["type"] == "message":  # the item streamed above
            assert item is not None
            done_item["id"] = item["id"]
            yield event("response.output_text.done", **_at(item), text=full, logprobs=[])
            yield event("response.content_part.done", **_at(item), part=_part(full))
        else:
            arguments = done_item["arguments"]
            started = {**done_item, "arguments": "", "status": "in_progress"}
            yield event("response.output_item.added", output_index=index, item=started)
            at = {"item_id": done_item["id"], "output_index": index}
            yield event("response.function_call_arguments.delta", **at, delta=arguments)
            yield event("response.function_call_arguments.done", **at, arguments=arguments)
        yield event("response.output_item.done", output_index=index, item=done_item)
    done = completed(base, output, finish_reason, usage.usage())
    await keep(done, answer)
    kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
    yield event(kind, response=done)


def _at(item: dict[str, Any]) -> dict[str, Any]:
    return {"item_id": item["id"], "output_index": 0, "content_index": 0}


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}

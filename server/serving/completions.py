"""POST /v1/completions (legacy): text prompts, n choices per prompt, legacy logprobs."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from sse_starlette import EventSourceResponse

from engine.protocol import TokenLogprob, TokenPrompt
from server.errors import invalid_request
from server.protocol import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
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


def _prompts(request: CompletionRequest) -> list[str | TokenPrompt]:
    """The request's prompts: a text, texts, token ids, or lists of token ids (as OpenAI's)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid_request("prompt must not be empty.", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return [p for p in prompt if isinstance(p, str)]
    if all(isinstance(p, int) for p in prompt):
        return [TokenPrompt(tuple(p for p in prompt if isinstance(p, int)))]
    if all(isinstance(p, list) for p in prompt):
        return [TokenPrompt(tuple(p)) for p in prompt if isinstance(p, list)]
    raise invalid_request(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists "
        "of token ids.",
        param="prompt",
    )


def _jobs(
    ctx: ServingContext, request: CompletionRequest, completion_id: str
) -> list[ChoiceRequest]:
    settings = ctx.settings
    if request.echo and request.logprobs is not None:
        raise invalid_request(
            "echo with logprobs is not supported (the prompt's logprobs are not computed).",
            param="echo",
        )
    if request.suffix:
        raise invalid_request("suffix is not supported.", param="suffix")
    if request.logit_bias:
        raise invalid_request("logit_bias is not supported.", param="logit_bias")
    n = check_n(settings, request.n)
    if request.best_of is not None and request.best_of != n:
        raise invalid_request("best_of is not supported (it must equal n).", param="best_of")
    prompts = _prompts(request)
    if len(prompts) * n > settings.max_n:
        raise invalid_request(f"len(prompt) * n must be at most {settings.max_n}.", param="prompt")
    logprobs = request.logprobs
    if logprobs is not None and logprobs > settings.max_top_logprobs:
        raise invalid_request(
            f"logprobs must be at most {settings.max_top_logprobs}.", param="logprobs"
        )
    sampling = sampling_params(
        settings,
        request,
        max_tokens=check_max_tokens(settings, request.max_tokens, "max_tokens"),
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
    )
    adapter = adapter_of(ctx.engine, request.model)
    return fan_out(completion_id, list(prompts), n, sampling, adapter)


class _LegacyLogprobs:
    """Builds the legacy parallel-list logprobs of one choice, keeping text offsets."""

    def __init__(self) -> None:
        self.offset = 0

    def convert(self, logprobs: list[TokenLogprob]) -> CompletionLogprobs:
        offsets = []
        for lp in logprobs:
            offsets.append(self.offset)
            self.offset += len(lp.token)
        return CompletionLogprobs(
            tokens=[lp.token for lp in logprobs],
            token_logprobs=[lp.logprob for lp in logprobs],
            top_logprobs=[
                {t.token: t.logprob for t in lp.top_logprobs} or {lp.token: lp.logprob}
                for lp in logprobs
            ],
            text_offset=offsets,
        )


def completion_logprobs(logprobs: list[TokenLogprob] | None) -> CompletionLogprobs | None:
    if logprobs is None:
        return None
    return _LegacyLogprobs().convert(logprobs)


async def create_completion(
    ctx: ServingContext, request: CompletionRequest, raw_request: Request, tenant: str
) -> Completion | EventSourceResponse:
    model = check_model(ctx.engine, request.model)
    completion_id = new_id("cmpl")
    jobs = _jobs(ctx, request, completion_id)
    params = ["prompt" if p == 0 else f"prompt[{p}]" for p in range(len(_prompts(request)))]
    jobs = await prepare_jobs(ctx, raw_request, tenant, jobs, params)
    echoed = await _echoed(ctx, request, tenant)  # after prepare_jobs checked token ids
    return await answer_choices(
        ctx,
        request,
        raw_request,
        tenant,
        jobs,
        lambda s: _gather(s, completion_id, model, echoed),
        lambda s, include_usage: _stream_chunks(s, completion_id, model, include_usage, echoed),
    )


async def _echoed(ctx: ServingContext, request: CompletionRequest, tenant: str) -> list[str]:
    """Each prompt's text, which `echo` puts before its choices' text (token prompts
    detokenized); none without echo."""
    if not request.echo:
        return []
    return [
        p if isinstance(p, str) else await ctx.engine.detokenize(p.ids, tenant=tenant)
        for p in _prompts(request)
    ]


async def _gather(
    streams: ChoiceStreams, completion_id: str, model: str, echoed: list[str]
) -> Completion:
    gathered, usage = await gather_choices(streams)
    prompt_of = {job.index: job.prompt_index for job in streams.jobs}
    choices = [
        CompletionChoice(
            index=i,
            text=(echoed[prompt_of[i]] if echoed else "") + choice.text,
            logprobs=completion_logprobs(choice.logprobs),
            finish_reason=choice.finish_reason,
        )
        for i, choice in sorted(gathered.items())
    ]
    return Completion(id=completion_id, model=model, choices=choices, usage=usage)


async def _stream_chunks(
    streams: ChoiceStreams, completion_id: str, model: str, include_usage: bool, echoed: list[str]
) -> AsyncIterator[str]:
    jobs = {job.index: job for job in streams.jobs}
    builders = {i: _LegacyLogprobs() for i in jobs}
    usage = UsageCounter()
    created = int(time.time())

    def chunk(choices: list[CompletionChoice], usage_info: Any = None) -> str:
        fields: dict[str, Any] = {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
        }
        if include_usage:
            fields["usage"] = usage_info
        return Completion(**fields).model_dump_json(exclude_unset=True)

    if echoed:  # each choice's prompt first, as vLLM streams it
        for index, job in jobs.items():
            yield chunk([CompletionChoice(index=index, text=echoed[job.prompt_index])])
    async for index, delta in streams:
        usage.add(jobs[index], delta)
        logprobs = builders[index].convert(delta.logprobs) if delta.logprobs else None
        if delta.text or logprobs or delta.finish_reason is not None:
            choice = CompletionChoice(
                index=index, text=delta.text, logprobs=logprobs, finish_reason=delta.finish_reason
            )
            yield chunk([choice])
    if include_usage:
        yield chunk([], usage.usage())

"""POST /tokenize, POST /detokenize, GET /tokenizer_info: vLLM's tokenizer endpoints, at the
root as vLLM serves them. Chat messages are rendered as a chat request would render them (tools
included), so `count` is what the chat's prompt_tokens will be; all the work runs off the
event loop, within the tenant's share of the preprocessing threads."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Depends

from server.auth import require_tenant
from server.errors import error_responses, invalid_request
from server.limits import JSONBodyRoute
from server.protocol import ChatCompletionRequest
from server.protocol_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from server.routes.dependencies import Serving
from server.serving.checks import check_model, counted_within
from server.serving.tool_formats import syntax_of
from server.serving.tools import plan_tools, render_messages

router = APIRouter(
    route_class=JSONBodyRoute,
    responses=error_responses(400, 401, 404, 413, 415, 429, 431, 500, 503),
)


@router.post("/tokenize", response_model=TokenizeResponse, response_model_exclude_none=True)
async def tokenize(
    body: TokenizeRequest, serving: Serving, tenant: str = Depends(require_tenant)
) -> TokenizeResponse:
    engine = serving.engine
    if body.model is not None:
        check_model(engine, body.model)
    if body.messages is None:
        assert body.prompt is not None  # one of the two, by validation
        with counted_within(serving.settings, "prompt") as limit:
            tokenized = await engine.tokenize(
                body.prompt,
                add_special_tokens=body.add_special_tokens is not False,
                token_strings=body.return_token_strs,
                tenant=tenant,
                token_limit=limit,
            )
    else:
        if body.continue_final_message:
            raise invalid_request(
                "continue_final_message is not supported.", param="continue_final_message"
            )
        if body.add_special_tokens:
            raise invalid_request(
                "add_special_tokens applies to a prompt; the chat template writes the special "
                "tokens of messages.",
                param="add_special_tokens",
            )
        chat = ChatCompletionRequest(
            model=engine.model.id,
            messages=body.messages,
            tools=body.tools,
            tool_choice=body.tool_choice,
        )
        tool_format = engine.model.tool_format
        plan = plan_tools(serving.settings, chat, tool_format)
        messages = render_messages(chat.messages, plan, syntax_of(tool_format))
        with counted_within(serving.settings, "messages") as limit:
            tokenized = await engine.tokenize(
                messages,
                generation_prompt=body.add_generation_prompt,
                token_strings=body.return_token_strs,
                tenant=tenant,
                token_limit=limit,
            )
    return TokenizeResponse(
        count=len(tokenized.ids),
        max_model_len=engine.model.max_model_len,
        tokens=tokenized.ids,
        token_strs=tokenized.strings,
    )


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(
    body: DetokenizeRequest, serving: Serving, tenant: str = Depends(require_tenant)
) -> DetokenizeResponse:
    if body.model is not None:
        check_model(serving.engine, body.model)
    return DetokenizeResponse(prompt=await serving.engine.detokenize(body.tokens, tenant=tenant))


@router.get(
    "/tokenizer_info", response_model=TokenizerInfoResponse, dependencies=[Depends(require_tenant)]
)
async def tokenizer_info(serving: Serving) -> TokenizerInfoResponse:
    info = serving.engine.tokenizer_info
    return TokenizerInfoResponse(**dataclasses.asdict(info))

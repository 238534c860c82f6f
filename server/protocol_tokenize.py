"""Bodies of /tokenize, /detokenize and /tokenizer_info, in vLLM's shapes (what
lm-evaluation-harness's remote tokenizer and vLLM's clients send and read)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from server.protocol import ChatMessage, OpenAIModel


class TokenizeRequest(OpenAIModel):
    """A text prompt (`prompt`) or chat messages (`messages`, with the tools a chat would
    render into them), exactly one of the two."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # text: default true; chat: the template decides
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_form(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        return self


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str


class TokenizerInfoResponse(OpenAIModel):
    tokenizer_class: str
    vocab_size: int
    model_max_length: int
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None

"""`PromptReader`: prompts to token ids and back, blocking, on whichever thread calls it (the
preprocessing threads; engine/scheduler/preprocess.py). Tokenizers mutate shared state while
encoding (the special-token switch), so every thread that encodes uses its own copy."""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from typing import Any

import torch

from engine.protocol import InvalidRequest, PreparedPrompt, Prompt, Tokenized, TokenPrompt
from engine.runner.chat_template import encode_chat, encode_chat_ids
from engine.runner.tokenize import checked_ids, encode_ids, encode_text


class PromptReader:
    """Reads prompts with a copy of `tokenizer` per calling thread."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = copy.deepcopy(tokenizer)  # copied again per thread
        self._threads = threading.local()
        self._copy_lock = threading.Lock()

    def tokenizer(self) -> Any:
        """This thread's own copy (made on its first call)."""
        tokenizer = getattr(self._threads, "tokenizer", None)
        if tokenizer is None:
            with self._copy_lock:
                tokenizer = copy.deepcopy(self._tokenizer)
            self._threads.tokenizer = tokenizer
        return tokenizer

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids (chat messages through the chat template)."""
        if isinstance(prompt, str):
            return encode_text(self.tokenizer(), prompt)
        return encode_chat(self.tokenizer(), prompt)

    def ids(self, prompt: Prompt, limit: int | None = None) -> torch.Tensor:
        """encode_prompt's ids (T,), never a long list of Python ints (engine/runner/tokenize.py);
        PromptTooLong as soon as there are more than `limit`."""
        if isinstance(prompt, str):
            return encode_ids(self.tokenizer(), prompt, limit=limit)
        return encode_chat_ids(self.tokenizer(), prompt, limit=limit)

    def encode(self, prompt: Prompt, limit: int | None = None) -> torch.Tensor:
        """`ids`, refusing an empty prompt."""
        ids = self.ids(prompt, limit)
        if not len(ids):
            raise InvalidRequest("the prompt is empty", param="prompt")
        return ids

    def count(self, prompt: Prompt) -> int:
        return len(self.ids(prompt))

    def prepare(self, prompt: Prompt | TokenPrompt, limit: int | None) -> PreparedPrompt:
        """Token ids read as they are; their text is what memory queries read (the prior, a
        larimar question). Text or chat: tokenized."""
        if not isinstance(prompt, TokenPrompt):
            ids = self.encode(prompt, limit)  # (T,)
            return PreparedPrompt(prompt, len(ids), ids)
        if not prompt.ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        tokenizer = self.tokenizer()
        token_ids = checked_ids(tokenizer, prompt.ids, "prompt", limit)
        text = str(tokenizer.decode(token_ids))
        return PreparedPrompt(text, len(token_ids), torch.tensor(token_ids, dtype=torch.long))

    def tokenize(
        self,
        prompt: Prompt,
        add_special_tokens: bool,
        generation_prompt: bool,
        token_strings: bool,
        limit: int | None,
    ) -> Tokenized:
        """/tokenize: a text's ids (special tokens as asked) or a chat's."""
        tokenizer = self.tokenizer()
        if isinstance(prompt, str):
            ids = encode_text(tokenizer, prompt, add_special_tokens=add_special_tokens, limit=limit)
        else:
            chat = encode_chat_ids(
                tokenizer, prompt, generation_prompt=generation_prompt, limit=limit
            )
            ids = chat.tolist()
        return Tokenized(ids, tokenizer.convert_ids_to_tokens(ids) if token_strings else None)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        tokenizer = self.tokenizer()
        return str(tokenizer.decode(checked_ids(tokenizer, token_ids, "tokens")))

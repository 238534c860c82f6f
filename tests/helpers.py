"""What the tests of every part share: a free local port, waiting for a condition with a
deadline (never a fixed sleep), an app or a process served on a real port, and the check that
a class implements a Protocol member by member."""

from __future__ import annotations

import asyncio
import inspect
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from types import TracebackType
from typing import Any

import uvicorn

HOST = "127.0.0.1"

# Words of haystack sentences (the Larimar tests): "<subject> <verb> <object>".
HAYSTACK_VERBS = (
    "waited for",
    "talked about",
    "remembered",
    "painted",
    "argued over",
    "discovered",
    "ignored",
    "celebrated",
    "measured",
    "described",
)
HAYSTACK_OBJECTS = (
    "the long summer",
    "a broken bridge",
    "the first snow",
    "an empty harbour",
    "the evening news",
    "a forgotten song",
    "the harvest",
    "a red kite",
)


def free_port() -> int:
    """A local TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


Message = str | Callable[[], object]


def _text(message: Message) -> str:
    return str(message() if callable(message) else message)


def wait_until(
    condition: Callable[[], object],
    message: Message,
    timeout_s: float = 10.0,
    interval_s: float = 0.01,
) -> None:
    """Poll `condition()` until it is true; past `timeout_s`, fail the test with `message` (a
    string, or a callable for one that is costly to build, such as a server's log)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(_text(message))
        time.sleep(interval_s)


async def wait_until_async(
    condition: Callable[[], object],
    message: Message,
    timeout_s: float = 10.0,
    interval_s: float = 0.01,
) -> None:
    """`wait_until` for a test on the event loop: polls without blocking the loop."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(_text(message))
        await asyncio.sleep(interval_s)


def answers_ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether a GET of `url` answers 200 now (False while nothing listens there)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return bool(response.status == 200)
    except OSError:  # refused, reset, timed out, or an HTTP error status
        return False


def wait_for_process(
    process: subprocess.Popen[bytes],
    ready_url: str,
    log: Callable[[], str],
    timeout_s: float,
    interval_s: float = 0.1,
) -> None:
    """Wait until `process` answers 200 at `ready_url`; fail with its log if it exits first or
    the deadline passes."""

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"the process exited with {process.returncode}:\n{log()}")
        return answers_ok(ready_url)

    wait_until(ready, lambda: f"not ready after {timeout_s} s:\n{log()}", timeout_s, interval_s)


class ThreadedServer:
    """uvicorn serving on a local port in a daemon thread. `start()` returns once it listens,
    `stop()` once it has ended; `start()` again serves on the same port. Also a context
    manager (start, then stop)."""

    def __init__(self, config: uvicorn.Config) -> None:
        self.config = config
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    @classmethod
    def of(cls, app: Any, port: int | None = None, *, lifespan: str = "auto") -> ThreadedServer:
        """`app` on `port` (a free one if None); lifespan "off" keeps its start-up and
        shutdown from running, so the same app can be stopped and served again."""
        config = uvicorn.Config(
            app, host=HOST, port=port or free_port(), log_level="error", lifespan=lifespan
        )
        return cls(config)

    @property
    def port(self) -> int:
        return int(self.config.port)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        server = uvicorn.Server(self.config)
        thread = threading.Thread(target=server.run, daemon=True)
        self.server, self.thread = server, thread
        thread.start()
        wait_until(
            lambda: server.started or not thread.is_alive(), "uvicorn did not start", timeout_s
        )
        assert server.started, f"uvicorn did not start on port {self.port}"

    def stop(self) -> None:
        if self.server is not None and self.thread is not None:
            self.server.should_exit = True
            self.thread.join(timeout=10)
        self.server = self.thread = None

    def __enter__(self) -> ThreadedServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def protocol_mismatches(cls: type, protocol: type) -> list[str]:
    """How `cls` differs from `protocol`, one line per member: missing, a property that is not
    one, async where the protocol is not (or the reverse), or another signature (parameter
    names, kinds, defaults and annotations). Empty when `cls` implements it exactly."""
    found: list[str] = []
    for name in (n for n in vars(protocol) if not n.startswith("_")):
        wanted = inspect.getattr_static(protocol, name)
        have = inspect.getattr_static(cls, name, None)
        if have is None:
            found.append(f"{name}: missing")
            continue
        if isinstance(wanted, property):
            if not isinstance(have, property):
                found.append(f"{name}: not a property")
                continue
            wanted, have = wanted.fget, have.fget
        if inspect.iscoroutinefunction(wanted) != inspect.iscoroutinefunction(have):
            found.append(f"{name}: async is {inspect.iscoroutinefunction(have)}, not as declared")
        expected = inspect.signature(wanted, eval_str=True)
        actual = inspect.signature(have, eval_str=True)
        if expected != actual:
            found.append(f"{name}{actual} is not {name}{expected}")
    return found


def save_tiny_llama(path: Any, tokenizer: Any, positions: int) -> Any:
    """A tiny random Llama (2 layers, hidden 64, seed 0) with `tokenizer`, saved at `path` for
    `--model` or load_model; `positions` its window. Returns path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path

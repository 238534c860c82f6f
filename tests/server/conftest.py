from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from fastapi import FastAPI

from server.app import build_app
from server.settings import ServerSettings
from tests.server.fake_engine import FakeEngine

API_KEY = "sk-test-key"
MODEL = "fake-model"


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(MODEL)


@pytest.fixture
def settings() -> ServerSettings:
    return ServerSettings(api_keys=[API_KEY], max_body_bytes=64 * 1024)


@pytest.fixture
def app(settings: ServerSettings, engine: FakeEngine) -> FastAPI:
    return build_app(settings, engine)


def asgi_client(app: FastAPI, api_key: str = API_KEY) -> httpx.AsyncClient:
    """An HTTP client calling the app in process, authenticated with api_key."""
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
        base_url="http://test",
        headers={"Authorization": f"Bearer {api_key}"},
    )


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(app) as http:
        yield http


@pytest.fixture
async def oai(app: FastAPI) -> AsyncIterator[openai.AsyncOpenAI]:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    http = httpx.AsyncClient(transport=transport, base_url="http://test")
    async with openai.AsyncOpenAI(
        base_url="http://test/v1", api_key=API_KEY, http_client=http, max_retries=0
    ) as sdk:
        yield sdk

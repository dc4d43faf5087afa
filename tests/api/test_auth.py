"""API keys: every /v1 route needs `Authorization: Bearer <key>`, admin routes their own key,
probes and scrapes none; the official client's api_key works as is."""
from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.api.conftest import MODEL_NAME, Served
from tokenmill.api.app import create_app
from tokenmill.api.auth import ApiKeys
from tokenmill.api.errors import APIError

KEY, ADMIN = "sk-test-1234", "admin-5678"
COMPLETION = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def guarded(server: Served) -> str:
    """A second app on the session's backend, with both keys."""
    return server.live.serve(create_app(server.live.backend, MODEL_NAME, manage_backend=False,
                                        keys=ApiKeys(KEY, ADMIN)))


def _request(url: str, method: str, path: str, key: str | None, **kwargs: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.request(method, url + path, headers=headers, timeout=30, **kwargs)


ROUTES = [("POST", "/v1/completions", {"json": COMPLETION}),
          ("POST", "/v1/chat/completions", {"json": {"model": MODEL_NAME, "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "hi"}]}}),
          ("GET", "/v1/models", {}), ("GET", f"/v1/models/{MODEL_NAME}", {}), ("GET", "/v1/nowhere", {})]


@pytest.mark.parametrize(("method", "path", "kwargs"), ROUTES, ids=[r[1] for r in ROUTES])
@pytest.mark.parametrize("key", [None, "wrong", ADMIN])
def test_no_v1_route_answers_without_the_key(guarded: str, method: str, path: str, kwargs: dict[str, Any],
                                             key: str | None) -> None:
    response = _request(guarded, method, path, key, **kwargs)
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(("method", "path", "kwargs"), ROUTES[:4], ids=[r[1] for r in ROUTES[:4]])
def test_with_the_key_the_v1_routes_serve(guarded: str, method: str, path: str, kwargs: dict[str, Any]) -> None:
    assert _request(guarded, method, path, KEY, **kwargs).status_code == 200
    assert _request(guarded, "GET", "/v1/nowhere", KEY).status_code == 404  # past the key: a plain 404


def test_health_and_metrics_stay_open_and_admin_takes_its_own_key(guarded: str) -> None:
    assert _request(guarded, "GET", "/health", None).status_code == 200
    assert _request(guarded, "GET", "/metrics", None).status_code == 200
    pin = {"prompt": "hello"}
    assert _request(guarded, "POST", "/admin/pin", KEY, json=pin).status_code == 401
    assert _request(guarded, "POST", "/admin/pin", ADMIN, json=pin).status_code != 401


def test_admin_falls_back_to_the_api_key_and_no_key_guards_nothing(server: Served) -> None:
    url = server.live.serve(create_app(server.live.backend, MODEL_NAME, manage_backend=False, keys=ApiKeys(KEY)))
    assert _request(url, "POST", "/admin/pin", None, json={"prompt": "x"}).status_code == 401
    assert _request(url, "POST", "/admin/pin", KEY, json={"prompt": "x"}).status_code != 401
    assert _request(server.url, "POST", "/v1/completions", None, json=COMPLETION).status_code == 200


def test_the_official_client_authenticates_with_api_key(guarded: str) -> None:
    good = openai.OpenAI(base_url=guarded + "/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=2).choices
    bad = openai.OpenAI(base_url=guarded + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_keys_come_from_the_flags_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_API_KEY", "from-env")
    monkeypatch.delenv("TOKENMILL_ADMIN_API_KEY", raising=False)
    assert ApiKeys.resolve(None, None) == ApiKeys("from-env", None)
    assert ApiKeys.resolve("flag", "adm") == ApiKeys("flag", "adm")
    monkeypatch.setenv("TOKENMILL_API_KEY", "")
    assert ApiKeys.resolve(None, None) == ApiKeys(None, None)  # an empty key is no key


def test_unguarded_admin_routes_answer_loopback_clients_only() -> None:
    keys = ApiKeys()
    keys.check_origin("/admin/workers", "127.0.0.1")
    keys.check_origin("/admin/workers", "::1")
    keys.check_origin("/admin/workers", None)  # an in-process transport
    keys.check_origin("/v1/models", "10.0.0.7")  # not an admin route
    with pytest.raises(APIError) as err:
        keys.check_origin("/admin/workers", "10.0.0.7")
    assert err.value.status == 403
    ApiKeys(admin="k").check_origin("/admin/workers", "10.0.0.7")  # with a key, the key decides

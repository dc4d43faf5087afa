"""A worker command the fleet refuses (`fleet.worker_control.WorkerCommandRefused`) leaves the API
as OpenAI error JSON with its status (400, 404, 409), field and code, counted like any refusal."""
from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tokenmill.api.errors import install_error_handlers
from tokenmill.fleet.worker_control import WorkerCommandRefused


@pytest.mark.parametrize("kind,status", [("invalid", 400), ("not_found", 404), ("conflict", 409)])
def test_a_refused_worker_command_is_its_status_naming_the_field(kind: str, status: int) -> None:
    counted: list[int] = []
    app = FastAPI()
    install_error_handlers(app, counted.append)

    @app.post("/admin/workers")
    async def refuse() -> None:
        raise WorkerCommandRefused(kind, "worker w-1 is already gone", "worker", "worker_not_serving")

    response = TestClient(app).post("/admin/workers")
    assert response.status_code == status
    assert response.json() == {"error": {"message": "worker w-1 is already gone", "type": "invalid_request_error",
                                         "param": "worker", "code": "worker_not_serving"}}
    assert counted == [status]


def test_a_refusal_of_an_unknown_kind_cannot_be_made() -> None:
    with pytest.raises(ValueError, match="kind"):
        WorkerCommandRefused("busy", "no", None)

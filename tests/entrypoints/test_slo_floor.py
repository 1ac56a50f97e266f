"""`sloserve serve --min-ttft-slo-ms`: a TTFT objective tighter than the floor is a 400 naming
the floor (body and header alike), one at or above it is served; bad flag values are errors
before any model is prepared."""

from __future__ import annotations

import asyncio

import pytest

from engine.entrypoints.cli import main
from engine.serving.api_server import ServerSettings
from tests.utils.inprocess_server import FakeCore, app_client

FLOOR_MS = 100.0


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return tiny_model("llama")


def test_objectives_below_the_floor_are_refused_and_others_served(model_dir):
    from transformers import AutoTokenizer

    fake = FakeCore(len(AutoTokenizer.from_pretrained(model_dir)))
    settings = ServerSettings(served_model_name="tiny", min_ttft_slo_ms=FLOOR_MS)

    async def run() -> None:
        async with app_client(model_dir, settings, fake=fake) as (http, _):
            base = {"prompt": "Deadlines matter", "max_tokens": 1}
            for body, headers, param in (({"ttft_slo_ms": 50}, {}, "ttft_slo_ms"),
                                         ({}, {"X-SLO-TTFT-MS": "99.5"}, "x-slo-ttft-ms")):
                response = await http.post("/v1/completions", json={**base, **body},
                                           headers=headers)
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert "floor of 100 ms" in error["message"] and "--min-ttft-slo-ms" in \
                    error["message"]
                assert error["param"] == param
            assert fake.requests == []  # probe: nothing refused reached the engine
            for body, headers in (({"ttft_slo_ms": 100}, {}), ({}, {"X-SLO-TTFT-MS": "250"}),
                                  ({}, {})):  # no objective at all is not below any floor
                response = await http.post("/v1/completions", json={**base, **body},
                                           headers=headers)
                assert response.status_code == 200, response.text
            assert [r.ttft_slo_ms for r in fake.requests] == [100.0, 250.0, None]

    asyncio.run(run())


@pytest.mark.parametrize("flags,message", [
    (["--min-ttft-slo-ms", "-5"], "argument --min-ttft-slo-ms: must be >= 0, got -5"),
    (["--default-ttft-slo-ms", "-1"], "argument --default-ttft-slo-ms: must be >= 0, got -1"),
    (["--default-ttft-slo-ms", "50", "--min-ttft-slo-ms", "100"], "is below --min-ttft-slo-ms"),
])
def test_bad_floor_flags_are_errors(flags, message, capsys):
    assert main(["serve", "--model", "/nonexistent", *flags]) == 2
    assert message in capsys.readouterr().err

"""Fuzz every operation of the OpenAPI with schemathesis against a real server: zero 5xx.

Valid and invalid inputs (schemathesis' positive and negative modes). Bounded: a
fixed number of examples per operation and mode, long polls capped at 0.2 s.
"""

from __future__ import annotations

import itertools
import pathlib
from typing import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error

from mx_server_procs import TOKEN, ServerProc

_AUTH = {"Authorization": f"Bearer {TOKEN}"}
_EXAMPLES = 25


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    tmp = tmp_path_factory.mktemp("fuzz")
    srv = ServerProc(f"sqlite:///{tmp}/mx.db", tmp,
                     env={"MX_SERVER_MAX_MANIFEST_BYTES": "65536"}).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server: ServerProc) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json", headers=_AUTH)


def test_no_server_errors(api_schema: schemathesis.BaseSchema, fuzz_server: ServerProc) -> None:
    # A plain loop over the operations instead of schemathesis.pytest.from_fixture,
    # which breaks on pytest 9 (it reads the private Function._nodeid).
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 15, [op.label for op in operations]
    failures: list[str] = []
    calls = 0
    for op, mode in itertools.product(operations, list(schemathesis.GenerationMode)):

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case: schemathesis.Case) -> None:
            if case.query and isinstance(case.query.get("wait"), (int, float)):
                case.query["wait"] = min(case.query["wait"], 0.2)  # keep long polls short
            nonlocal calls
            calls += 1
            case.call_and_validate(base_url=fuzz_server.url, headers=_AUTH, timeout=30,
                                   checks=[not_a_server_error])

        try:
            fuzz()
        except Unsatisfiable:
            # Negative mode for an operation without parameters or body: nothing to break.
            assert mode is schemathesis.GenerationMode.NEGATIVE, op.label
        except Exception as exc:  # noqa: BLE001 - collect every operation's failure
            failures.append(f"{op.label} ({mode.value}): {exc}")
    assert not failures, "\n\n".join(failures)
    assert calls >= 5 * len(operations), f"only {calls} requests sent"


def test_server_log_has_no_tracebacks(fuzz_server: ServerProc) -> None:
    # Runs after the fuzz cases in this module (file order): a handled 4xx never logs
    # a traceback, so one here is a bug even if the response was not a 5xx.
    assert "Traceback" not in pathlib.Path(fuzz_server.log_path).read_text()

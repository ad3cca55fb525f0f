"""Engines' compiled-artifact outcomes reach the control plane's /metrics (real uvicorn)."""

from __future__ import annotations

import httpx
import pytest

from modelexpress.errors import ValidationError

IDENTITY = "0123456789abcdef0123456789abcdef"


def _samples(server, name: str) -> dict[str, float]:  # noqa: ANN001
    text = httpx.get(f"{server.url}/metrics", timeout=10.0,
                     headers={"Authorization": f"Bearer {server.token}"}).text
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels[len(name):]] = float(value)
    return out


def test_outcomes_are_counted_per_kind_and_outcome(server, client) -> None:  # noqa: ANN001
    before = _samples(server, "mx_artifacts_total")
    client.report_artifact_outcome(IDENTITY, "vllm_compile", "hit", compiled=True,
                                   source_id="s1", detail="compiled again, no kernel built")
    client.report_artifact_outcome(IDENTITY, "vllm_compile", "refused",
                                   detail="signed with another key")
    after = _samples(server, "mx_artifacts_total")
    hit = '{kind="vllm_compile",outcome="hit"}'
    refused = '{kind="vllm_compile",outcome="refused"}'
    assert after[hit] == before.get(hit, 0) + 1
    assert after[refused] == before.get(refused, 0) + 1
    compiled = _samples(server, "mx_artifacts_compiled_anyway_total")
    assert compiled['{kind="vllm_compile"}'] >= 1


@pytest.mark.parametrize("bad", [dict(outcome="great"), dict(kind="Bad Kind"),
                                 dict(identity_id="not-an-id")])
def test_a_bad_report_is_a_validation_error(client, bad) -> None:  # noqa: ANN001
    args = {"identity_id": IDENTITY, "kind": "vllm_compile", "outcome": "hit", **bad}
    with pytest.raises(ValidationError):
        client.report_artifact_outcome(args.pop("identity_id"), args.pop("kind"),
                                       args.pop("outcome"))

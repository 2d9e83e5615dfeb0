"""GET/PATCH /v1/agl/quota over real HTTP (README "Quotas"): every key reads its own project's
quotas, only an admin key sets them; bad caps are refused with the field named."""

from __future__ import annotations

from datetime import timedelta

import httpx
import pytest
from django.utils import timezone

from store import rules
from store.models import Project, UsageEntry
from tests.api.conftest import Keys

pytestmark = pytest.mark.postgres


def call(api_server, key: str, method: str = "GET", body: object = None) -> httpx.Response:
    return httpx.request(method, api_server.url + "/v1/agl/quota", json=body,
                         headers={"Authorization": f"Bearer {key}"})


def test_an_admin_key_sets_its_projects_cap_and_every_key_reads_it(api_server, keys: Keys):
    assert call(api_server, keys.runner).json() == {
        "project": "api", "gpu_seconds_per_day": None, "gpu_seconds_used": None,
        "reached": False, "next_free": None, "reason": None}
    for key in (keys.runner, keys.algorithm):
        assert call(api_server, key, "PATCH", {"gpu_seconds_per_day": 1}).status_code == 403
    row = UsageEntry.objects.create(project=keys.project, kind="step", gpu_seconds=3612,
                                    created_at=timezone.now() - timedelta(hours=1))
    answer = call(api_server, keys.admin, "PATCH", {"gpu_seconds_per_day": 3600})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    frees = row.created_at + rules.QUOTA_WINDOW
    assert (body["gpu_seconds_per_day"], body["gpu_seconds_used"], body["reached"]) == (
        3600, 3612, True)
    assert body["next_free"] == pytest.approx(frees.timestamp())
    assert body["reason"].startswith("quota: 3,612 of 3,600 GPU-seconds in the last 24 h")
    assert Project.objects.get(name="api-other").gpu_seconds_per_day is None  # its own only
    assert call(api_server, keys.admin, "PATCH", {}).json()["gpu_seconds_per_day"] == 3600
    assert call(api_server, keys.admin, "PATCH", {"gpu_seconds_per_day": None}).json()[
        "gpu_seconds_per_day"] is None


@pytest.mark.parametrize("cap", [-1, "lots", True, [1]])
def test_a_bad_cap_is_refused_with_its_field(api_server, keys: Keys, cap):
    answer = call(api_server, keys.admin, "PATCH", {"gpu_seconds_per_day": cap})
    assert answer.status_code == 422, answer.text
    assert "gpu_seconds_per_day" in answer.text
    assert Project.objects.get(pk=keys.project.pk).gpu_seconds_per_day is None

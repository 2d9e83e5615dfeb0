import pytest

from store import selectors, services
from store.errors import InvalidInput, NotFound
from store.models import ResourceVersion
from store.services import RolloutSpec
from store.services.resources import resources_delete
from tests.conftest import claim, enqueue

LLM = {"llm": {"resource_type": "llm", "endpoint": "http://127.0.0.1:1", "model": "m"}}


def bump(project, rs_id, n):
    for i in range(n):
        services.resources_update(project=project, resources_id=rs_id,
                                  resources={"p": {"resource_type": "prompt_template", "i": i}})


def test_add_creates_version_one_and_update_appends(project):
    first = services.resources_add(project=project, resources=LLM)
    rs_id = first.resource_set.resources_id
    assert rs_id.startswith("rs-") and first.version == 1
    second = services.resources_update(project=project, resources_id=rs_id, resources={})
    assert second.version == 2
    assert selectors.resources_get(project=project, resources_id=rs_id).version == 2
    assert selectors.resources_get(project=project, resources_id=rs_id, version=1).resources == LLM
    assert [v.version for v in selectors.resources_versions(project=project, resources_id=rs_id)] == [1, 2]


def test_update_creates_a_missing_id(project):
    version = services.resources_update(project=project, resources_id="rs-mine", resources=LLM)
    assert version.version == 1


def test_latest_is_most_recently_updated(project):
    a = services.resources_add(project=project, resources=LLM)
    b = services.resources_add(project=project, resources=LLM)
    assert selectors.resources_latest(project=project).resource_set.resources_id == b.resource_set.resources_id
    services.resources_update(project=project, resources_id=a.resource_set.resources_id, resources=LLM)
    assert selectors.resources_latest(project=project).resource_set.resources_id == a.resource_set.resources_id


def test_resources_are_per_project(project, other_project):
    a = services.resources_add(project=project, resources=LLM)
    rid = a.resource_set.resources_id
    with pytest.raises(NotFound):
        selectors.resources_get(project=other_project, resources_id=rid)
    assert selectors.resources_latest(project=other_project) is None
    # The same id in another project is another history: no collision, nothing shared.
    theirs = services.resources_update(project=other_project, resources_id=rid,
                                       resources={"x": {"y": 1}})
    assert (theirs.version, theirs.resource_set.resources_id) == (1, rid)
    mine = services.resources_update(project=project, resources_id=rid, resources=LLM)
    assert mine.version == 2
    assert selectors.resources_get(project=other_project, resources_id=rid).resources == {
        "x": {"y": 1}}
    assert [v.version for v in selectors.resources_versions(project=project, resources_id=rid)
            ] == [1, 2]
    resources_delete(project=other_project, resources_id=rid)
    assert selectors.resources_get(project=project, resources_id=rid).version == 2


def test_chosen_ids_shared_by_projects_pin_their_own_versions(project, other_project):
    services.resources_update(project=project, resources_id="main", resources=LLM)
    services.resources_update(project=project, resources_id="main", resources=LLM)
    services.resources_update(project=other_project, resources_id="main", resources=LLM)
    mine = services.rollout_enqueue(project=project, spec=RolloutSpec(input=1,
                                                                      resources_id="main"))
    theirs = services.rollout_enqueue(project=other_project, spec=RolloutSpec(input=1))
    assert (mine.resources_id, mine.resources_version) == ("main", 2)
    assert (theirs.resources_id, theirs.resources_version) == ("main", 1)


def test_bad_resources_are_refused(project):
    with pytest.raises(InvalidInput):
        services.resources_add(project=project, resources=["x"])
    with pytest.raises(InvalidInput):
        services.resources_add(project=project, resources={"x": 1})


def test_query_resources_lists_ids_at_latest_version(project):
    a = services.resources_add(project=project, resources=LLM)
    services.resources_add(project=project, resources=LLM)
    bump(project, a.resource_set.resources_id, 2)
    page = selectors.resources_query(project=project, sort_by="version", sort_order="desc")
    assert page.total == 2 and page.items[0].version == 3


def test_retention_keeps_last_n_pinned_and_kept_versions(project):
    v1 = services.resources_add(project=project, resources=LLM)
    rs_id = v1.resource_set.resources_id
    enqueue(project, 1)  # pins version 1 while unfinished
    bump(project, rs_id, 2)  # versions 2, 3
    services.resources_set_keep(project=project, resources_id=rs_id, version=2)
    bump(project, rs_id, 5)  # versions 4..8
    deleted = services.resources_retain(keep_last=2)
    left = sorted(ResourceVersion.objects.values_list("version", flat=True))
    assert left == [1, 2, 7, 8] and deleted == 4


def test_retention_releases_versions_of_finished_rollouts(project):
    v1 = services.resources_add(project=project, resources=LLM)
    enqueue(project, 1)
    bump(project, v1.resource_set.resources_id, 3)
    rollout, attempt = claim(project)
    services.attempt_update(project=project, rollout_id=rollout.pk,
                            attempt_id=attempt.attempt_id, status="succeeded")
    services.resources_retain(keep_last=1, project=project)
    assert list(ResourceVersion.objects.values_list("version", flat=True)) == [4]

"""The operator's console in the admin: rollouts newest first with reward, agent, job, duration
and worker; read-only rollout, attempt and span pages; state changes through actions that call
the services; a failure's traceback as text; an attempt's span tree (also in Chromium)."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest

from store import services
from store.models import Rollout
from store.spantree import span_tree
from tests.browser import chromium
from tests.conftest import claim, enqueue
from tests.test_span_services import span

pytestmark = pytest.mark.django_db(transaction=True)
SERVER_ADDR, DRIVER_PORT = "127.0.0.1:18431", 18432
TRACEBACK = 'Traceback (most recent call last):\n  File "agent.py", line 3\nValueError: bad <move>'


@pytest.fixture
def console(project):
    """A failed rollout with a traceback; one of a training job with a span tree and a reward;
    one still queued."""
    failed, traced, queued = enqueue(project, 3)
    for minutes, rollout in enumerate((failed, traced, queued)):  # oldest to newest
        Rollout.objects.filter(pk=rollout.pk).update(
            start_time=rollout.start_time + timedelta(minutes=minutes))
    Rollout.objects.filter(pk=traced.pk).update(
        metadata={"trainer.job": 7, "trainer.step": 2}, dispatch_target="examples.cipher:agent")
    _, attempt = claim(project, worker_id="rollouts@box1")
    services.attempt_update(project=project, rollout_id=failed.pk, attempt_id=attempt.attempt_id,
                            status="failed", metadata={"error": TRACEBACK})
    _, attempt = claim(project, worker_id="rollouts@box2")
    tree = [  # (span id, parent, name, start, end, attributes)
        ("a1", None, "agent.run", 100.0, 101.5, {}),
        ("b1", "a1", "llm.call", 100.1, 100.3, {}),
        ("b2", "a1", "agentlightning.message", 100.4, 100.4,
         {"agentlightning.message.body": "guessed 3"}),
        ("c1", "b1", "http.post", 100.15, 100.25, {}),
        ("r1", None, "agentlightning.annotation", 101.6, 101.6,
         {"agentlightning.reward.0.value": 0.75}),
    ]
    for n, (span_id, parent, name, start, end, attributes) in enumerate(tree, start=1):
        services.span_add(project=project, span=span(
            traced, attempt, n, span_id=span_id, parent_id=parent, name=name, start_time=start,
            end_time=end, attributes=attributes))
    services.attempt_update(project=project, rollout_id=traced.pk, attempt_id=attempt.attempt_id,
                            status="succeeded")
    return {"failed": failed, "traced": traced, "queued": queued, "attempt": attempt}


def _rows(html: str) -> list[str]:
    body = html.split('id="result_list"', 1)[1].split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    return re.findall(r"<tr.*?</tr>", body, flags=re.S)


def test_the_rollout_list_is_newest_first_with_reward_agent_job_duration_and_worker(
        staff, console):
    html = staff.get("/admin/store/rollout/").text
    rows = _rows(html)
    assert [console[k].pk in row for k, row in zip(("queued", "traced", "failed"), rows,
                                                    strict=True)] == [True] * 3
    traced = rows[1]
    assert "0.750" in traced and "examples.cipher:agent" in traced
    assert '<a href="/jobs/7/">job 7</a> / step 2' in traced and "rollouts@box2" in traced
    assert re.search(r"\d+\.\d s<", traced)  # a duration, not a date
    for query, expected in (("status__exact=failed", "failed"), ("job=7", "traced"),
                            ("agent=examples.cipher%3Aagent", "traced")):
        rows = _rows(staff.get(f"/admin/store/rollout/?{query}").text)
        assert len(rows) == 1 and console[expected].pk in rows[0], query


def test_rollout_attempt_and_span_pages_are_read_only_and_show_the_traceback_as_text(
        staff, console):
    url = f"/admin/store/rollout/{console['failed'].pk}/change/"
    page = staff.get(url)
    assert page.status_code == 200 and 'name="_save"' not in page.text
    assert "<textarea" not in page.text
    assert ('ValueError: bad &lt;move&gt;</pre>' in page.text
            and 'Traceback (most recent call last):\n  File' in page.text)
    assert staff.post(url, {"status": "succeeded"}).status_code == 403
    console["failed"].refresh_from_db()
    assert console["failed"].status == "failed"
    attempt = staff.get(f"/admin/store/attempt/{console['attempt'].pk}/change/")
    assert attempt.status_code == 200 and 'name="_save"' not in attempt.text
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", attempt.text)  # times to the second
    assert staff.get("/admin/store/rollout/add/").status_code == 403


def test_an_attempt_page_shows_its_span_tree_with_durations_rewards_and_messages(
        staff, console):
    html = staff.get(f"/admin/store/attempt/{console['attempt'].pk}/change/").text
    table = html.split('class="span-tree"', 1)[1].split("</table>", 1)[0]
    names = re.findall(r'padding-left: (\d)em"><a href="[^"]+">([^<]+)</a>', table)
    assert names == [("1", "agent.run"), ("2", "llm.call"), ("3", "http.post"),
                     ("2", "agentlightning.message"), ("1", "agentlightning.annotation")]
    assert "1970-01-01 00:01:40.000" in table and "1500 ms" in table
    assert re.search(r'<tr class="reward">.*?reward 0.750', table, flags=re.S)
    assert re.search(r'<tr class="message">.*?guessed 3', table, flags=re.S)


def test_a_span_page_shows_dates_durations_and_links_its_parent(staff, console):
    child = console["attempt"].spans.get(span_id="c1")
    html = staff.get(f"/admin/store/span/{child.pk}/change/").text
    parent = console["attempt"].spans.get(span_id="b1")
    assert f'href="/admin/store/span/{parent.pk}/change/">llm.call (b1)</a>' in html
    assert "1970-01-01 00:01:40.150 UTC" in html and "100.0 ms" in html


def test_cancel_and_requeue_go_through_the_services(staff, console):
    changelist = "/admin/store/rollout/"
    staff.post(changelist, {"action": "cancel", "_selected_action": [console["queued"].pk]})
    staff.post(changelist, {"action": "requeue", "_selected_action": [console["failed"].pk]})
    statuses = dict(Rollout.objects.values_list("pk", "status"))
    assert statuses[console["queued"].pk] == "cancelled"
    assert statuses[console["failed"].pk] == "requeuing"


def test_a_span_cycle_or_a_missing_parent_still_lists_every_span_once(console):
    spans = list(console["attempt"].spans.all())
    by_id = {s.span_id: s for s in spans}
    by_id["a1"].parent_id = "c1"  # a1 -> c1 -> b1 -> a1: a cycle
    by_id["r1"].parent_id = "gone"
    rows = span_tree(spans)
    assert sorted(r.span.span_id for r in rows) == sorted(by_id)


def test_the_console_pages_render_in_chromium(staff, console, live_site, tmp_path):
    with chromium(DRIVER_PORT, tmp_path / "profile") as browser:
        browser.login(live_site, staff.cookies["sessionid"].value)
        browser.get(f"{live_site}/admin/store/rollout/")
        rows = browser.js("return document.querySelectorAll('#result_list tbody tr').length")
        browser.screenshot("console-rollouts.png")
        browser.get(f"{live_site}/admin/store/attempt/{console['attempt'].pk}/change/")
        tree = browser.js("return document.querySelectorAll('table.span-tree tbody tr').length")
        reward_bg = browser.js("return getComputedStyle(document.querySelector("
                               "'table.span-tree tr.reward td')).backgroundColor")
        browser.screenshot("console-attempt.png")
    assert rows == 3 and tree == 5
    assert reward_bg == "rgb(230, 244, 234)"

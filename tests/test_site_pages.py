"""The landing page and static files, served by the app itself with DEBUG off; the admin looks
styled in a real headless Chromium."""

from __future__ import annotations

import pytest

from store import services
from tests.browser import chromium
from tests.conftest import enqueue

pytestmark = pytest.mark.django_db(transaction=True)
SERVER_ADDR, DRIVER_PORT = "127.0.0.1:18401", 18402


def test_the_landing_page_links_everywhere_and_counts_for_staff(staff, settings):
    settings.FLOWER_URL = "http://flower.example:5555/"
    project = services.project_create(name="home")
    enqueue(project, 3)
    html = staff.get("/").text
    for link in ("/jobs/", "/admin/", "/api/docs/", "/metrics", "http://flower.example:5555/"):
        assert f'href="{link}"' in html, link
    assert '<span class="status queuing">queuing</span> 3' in html
    assert "no live worker" not in html and "rollouts: 0" in html


def test_the_landing_page_shows_no_counts_to_anonymous_visitors(client, project):
    enqueue(project, 2)
    html = client.get("/").text
    assert "queuing" not in html and "Log in" in html


def test_static_files_are_served_with_debug_off(client, settings):
    assert settings.DEBUG is False
    css = client.get("/static/admin/css/base.css")
    assert css.status_code == 200 and css["Content-Type"].startswith("text/css")
    assert b"".join(css.streaming_content).startswith(b"/*")


def test_the_admin_renders_styled_in_chromium(staff, live_site, tmp_path, settings):
    assert settings.DEBUG is False
    with chromium(DRIVER_PORT, tmp_path / "profile") as browser:
        browser.login(live_site, staff.cookies["sessionid"].value)
        browser.get(f"{live_site}/admin/")
        header = browser.js("return getComputedStyle(document.getElementById('header'))"
                            ".backgroundColor")
        sheets = browser.js("return document.styleSheets.length")
        shot = browser.screenshot("admin-index.png")
        browser.get(f"{live_site}/")
        title = browser.js("return document.title")
    assert header not in ("rgba(0, 0, 0, 0)", "transparent")  # admin's base.css applied
    assert sheets >= 2
    assert shot[:8] == b"\x89PNG\r\n\x1a\n"
    assert title == "Home · Lightning"

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.urls import reverse

from core import env
from store import services
from tests.conftest import claim, enqueue

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def staff_client(client, django_user_model):
    user = django_user_model.objects.create_superuser("admin", "a@example.com", "pw")
    client.force_login(user)
    return client


def test_admin_pages_render_for_every_store_model(staff_client, project):
    enqueue(project, 2)
    rollout, attempt = claim(project)
    services.span_add(project=project, span={
        "rollout_id": rollout.pk, "attempt_id": attempt.attempt_id, "sequence_id": 1,
        "trace_id": "a" * 32, "span_id": "b" * 16, "name": "s",
    })
    version = services.resources_add(project=project, resources={"p": {"resource_type": "x"}})
    services.api_key_create(project=project, role="runner")
    for model in ["project", "apikey", "rollout", "attempt", "span", "resourceset", "worker"]:
        response = staff_client.get(reverse(f"admin:store_{model}_changelist"))
        assert response.status_code == 200, model
    pages = [("rollout", rollout.pk), ("resourceset", version.resource_set_id),
             ("project", project.pk)]
    for model, pk in pages:
        response = staff_client.get(reverse(f"admin:store_{model}_change", args=[pk]))
        assert response.status_code == 200, model
    assert rollout.pk in staff_client.get(
        reverse("admin:store_rollout_changelist") + f"?q={rollout.pk}").content.decode()


def test_admin_action_shows_a_new_key_once_on_a_page_not_in_a_cookie(staff_client, project):
    """The key went into a message, which Django keeps in a signed (readable) cookie until the
    next page (issue 11, finding 6); now it is on the action's own answer only."""
    response = staff_client.post(reverse("admin:store_project_changelist"), {
        "action": "make_runner_key", "_selected_action": [project.pk],
    })
    assert response.status_code == 200
    assert project.api_keys.count() == 1
    page = response.content.decode()
    assert "shown once" in page
    keys = re.findall(r"agl_[A-Za-z0-9_-]{40,}", page)
    assert len(set(keys)) == 1
    key = keys[0]
    assert services.api_key_authenticate(raw=key).project == project
    assert "no-store" in response["Cache-Control"]
    cookies = " ".join(f"{c.key}={c.value}" for c in response.cookies.values())
    cookies += " " + " ".join(f"{c.key}={c.value}" for c in staff_client.cookies.values())
    assert key not in cookies and "messages" not in response.cookies
    later = staff_client.get(reverse("admin:store_project_changelist")).content.decode()
    assert key not in later and key[12:] not in later


@pytest.mark.parametrize("reader,value", [
    (lambda: env.env_bool("X_TEST", False), "maybe"),
    (lambda: env.env_int("X_TEST", 1), "ten"),
    (lambda: env.env_int("X_TEST", 1, minimum=1), "0"),
    (lambda: env.env_float("X_TEST", 1.0), "fast"),
])
def test_bad_setting_values_fail_loudly(monkeypatch, reader, value):
    monkeypatch.setenv("X_TEST", value)
    with pytest.raises(ImproperlyConfigured, match="X_TEST"):
        reader()


def test_database_url_parsing():
    pg = env.database_from_url("postgres://u:p%40ss@db.example:6543/name?sslmode=require")
    assert (pg["NAME"], pg["USER"], pg["PASSWORD"], pg["HOST"], pg["PORT"]) == (
        "name", "u", "p@ss", "db.example", "6543")
    assert pg["OPTIONS"] == {"sslmode": "require", "server_side_binding": True,
                             "prepare_threshold": 5}
    assert (pg["CONN_MAX_AGE"], pg["CONN_HEALTH_CHECKS"], pg["PREPARED_STATEMENTS"]) == (
        60, True, True)
    tuned = env.database_from_url(
        "postgres://h/n?conn_max_age=0&conn_health_checks=false&prepared_statements=false")
    assert (tuned["CONN_MAX_AGE"], tuned["CONN_HEALTH_CHECKS"], tuned["PREPARED_STATEMENTS"],
            tuned["OPTIONS"]) == (0, False, False, {"server_side_binding": True,
                                                    "prepare_threshold": None})
    with pytest.raises(ImproperlyConfigured, match="conn_health_checks"):
        env.database_from_url("postgres://h/n?conn_health_checks=maybe")
    with pytest.raises(ImproperlyConfigured, match="prepared_statements"):
        env.database_from_url("postgres://h/n?prepared_statements=maybe")
    with pytest.raises(ImproperlyConfigured):
        env.database_from_url("mysql://x/y")
    with pytest.raises(ImproperlyConfigured):
        env.database_from_url("postgres://host/")


def test_secret_key_is_required_with_a_database_url():
    environ = {k: v for k, v in os.environ.items() if k != "DJANGO_SECRET_KEY"}
    environ.update(DATABASE_URL="postgres://postgres@127.0.0.1:5432/x",
                   DJANGO_SETTINGS_MODULE="lightning_site.settings")
    out = subprocess.run([sys.executable, "-c", "import django; django.setup()"],
                         cwd=ROOT, env=environ, capture_output=True, text=True)
    assert out.returncode != 0 and "DJANGO_SECRET_KEY" in out.stderr


@pytest.mark.slow
def test_embedded_default_runs_the_store_demo_on_sqlite(tmp_path):
    environ = {k: v for k, v in os.environ.items()
               if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE")}
    environ["LIGHTNING_DATA_DIR"] = str(tmp_path)
    manage = [sys.executable, "manage.py"]
    subprocess.run(manage + ["migrate", "-v0"], cwd=ROOT, env=environ, check=True, timeout=300)
    out = subprocess.run(manage + ["store_demo", "--rollouts", "30"], cwd=ROOT, env=environ,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert '"succeeded": 30' in out.stdout
    assert (tmp_path / "lightning.sqlite3").exists()


def test_secret_key_is_required_with_a_database_url_even_in_debug_mode():
    """DJANGO_DEBUG=true with DATABASE_URL used the fixed key published in settings.py
    (issue 11, finding 8)."""
    environ = {k: v for k, v in os.environ.items() if k != "DJANGO_SECRET_KEY"}
    environ.update(DATABASE_URL="postgres://postgres@127.0.0.1:5432/x", DJANGO_DEBUG="true",
                   DJANGO_SETTINGS_MODULE="lightning_site.settings")
    out = subprocess.run([sys.executable, "-c", "import django; django.setup()"],
                         cwd=ROOT, env=environ, capture_output=True, text=True)
    assert out.returncode != 0 and "DJANGO_SECRET_KEY" in out.stderr


SECURE_ENV = {"DJANGO_SECURE_SSL_REDIRECT": "true", "DJANGO_SECURE_HSTS_SECONDS": "31536000",
              "DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS": "true", "DJANGO_SECURE_HSTS_PRELOAD": "true",
              "DJANGO_SECURE_COOKIES": "true"}


@pytest.mark.parametrize("secure", [False, True])
def test_production_settings_pass_check_deploy_behind_the_secure_settings(secure: bool):
    """`check --deploy` warned W004/W008/W012/W016 with no way to turn them off from the
    environment (issue 11, finding 8)."""
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("DJANGO_SECURE_") and k != "DJANGO_DEBUG"}
    environ.update(DATABASE_URL="postgres://postgres@127.0.0.1:5432/x",
                   DJANGO_SECRET_KEY="k" * 20 + "-a-long-random-enough-key-0123456789-xyz",
                   DJANGO_SETTINGS_MODULE="lightning_site.settings",
                   **(SECURE_ENV if secure else {}))
    out = subprocess.run([sys.executable, "manage.py", "check", "--deploy"], cwd=ROOT,
                         env=environ, capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    found = set(re.findall(r"security\.W\d+", text))
    if secure:
        assert found == set(), text
    else:
        assert {"security.W004", "security.W008", "security.W012", "security.W016"} <= found


def test_admin_login_is_throttled(client, django_user_model, settings):
    """The admin's login had no limit on guesses (issue 11, finding 8)."""
    from django.core.cache import cache

    cache.clear()
    settings.ADMIN_LOGIN_MAX_FAILURES = 3
    django_user_model.objects.create_superuser("boss", "b@example.com", "right-password")
    url = reverse("admin:login")
    for _ in range(3):
        response = client.post(url, {"username": "boss", "password": "wrong"})
        assert response.status_code == 200  # the form again, with its error
    blocked = client.post(url, {"username": "boss", "password": "right-password"})
    assert blocked.status_code == 429 and int(blocked["Retry-After"]) > 0
    assert "_auth_user_id" not in client.session
    # Another user name from the same address is not locked out by this one's failures.
    django_user_model.objects.create_superuser("other", "o@example.com", "other-password")
    response = client.post(url, {"username": "other", "password": "other-password"})
    assert response.status_code == 302
    cache.clear()

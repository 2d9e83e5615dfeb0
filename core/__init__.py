"""The kernel the apps share: the Celery app, queue names, the publisher, the retry policy,
the registries of reconcilers, takeovers and backlogs, settings readers, console helpers, the
embedded default's in-process workers. It imports no package of ours (README "Layout";
tests/test_imports.py holds it to that)."""

"""Every option of our commands says what it does, and the examples they give exist."""

from __future__ import annotations

import re

import pytest
from django.core.management import get_commands, load_command_class
from django.utils.module_loading import import_string

OURS = {"store", "runners", "trainer"}
DJANGO_OPTIONS = {"help", "version", "verbosity", "settings", "pythonpath", "traceback",
                  "no_color", "force_color", "skip_checks"}
COMMANDS = sorted((name, app) for name, app in get_commands().items() if app in OURS)


@pytest.mark.parametrize(("name", "app"), COMMANDS, ids=[n for n, _ in COMMANDS])
def test_every_option_has_help_and_its_examples_exist(name, app):
    command = load_command_class(app, name)
    assert command.help, name
    parser = command.create_parser("manage.py", name)
    texts = [command.help]
    for action in parser._actions:
        if action.dest in DJANGO_OPTIONS:
            continue
        assert action.help, f"{name}: {action.option_strings or action.dest} has no help"
        texts.append(action.help)
    for path in re.findall(r"\bexamples(?:\.\w+)+(?::\w+)?", " ".join(texts)):
        target = import_string(path.replace(":", "."))
        assert callable(target), path


def test_the_commands_list_covers_the_operators_commands():
    names = {name for name, _ in COMMANDS}
    assert {"serve", "train", "train_list", "queue_watch", "rollouts_enqueue"} <= names

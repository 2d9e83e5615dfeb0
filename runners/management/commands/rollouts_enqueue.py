import json
from contextlib import nullcontext
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from core.console import progress_stream, quiet_libraries
from core.embedded import embedded_workers
from runners import selectors, services
from runners.llm import PROXY_LLM
from runners.management.commands._progress import follow, project_named, reward_line
from store import selectors as store_selectors
from store import services as store_services
from store.errors import StoreError
from store.services import RolloutSpec
from store.statemachine import ROLLOUT_TERMINAL


class Command(BaseCommand):
    help = ("Enqueue a batch of rollouts for an agent, run by Celery workers. In the embedded "
            "default (no DATABASE_URL, no CELERY_BROKER_URL) this process runs the workers and "
            "waits for the batch; otherwise --wait shows progress until it is done.")

    def add_arguments(self, parser):
        parser.add_argument("project", help="the project's name")
        parser.add_argument("--agent", required=True, help="dotted path, e.g. examples.hello:agent")
        parser.add_argument("--count", type=int, default=1, help="rollouts to enqueue (1)")
        parser.add_argument("--input", default=None,
                            help="JSON input for every rollout (default {'index': i})")
        parser.add_argument("--inputs-file", default=None, help="JSON lines, one input each")
        parser.add_argument("--resource", action="append", default=[],
                            metavar="NAME=JSON|NAME=@FILE",
                            help="a resource every rollout pins, repeatable: NAME=JSON or "
                            "NAME=@file.json (a proxy_llm resource is routed to each attempt "
                            "and given its api_key)")
        parser.add_argument("--llm", metavar="MODEL", default=None,
                            help="shorthand for an `llm` resource: MODEL served by the model "
                            "gateway at LLM_GATEWAY_URL, routed to each attempt with a key")
        parser.add_argument("--mode", choices=["train", "val", "test"], default=None,
                            help="AGL's rollout mode (default none)")
        parser.add_argument("--max-attempts", type=int, default=1,
                            help="attempts per rollout, retries included (1)")
        parser.add_argument("--retry-on", action="append", default=[],
                            help="attempt status that retries (failed, timeout, unresponsive)")
        parser.add_argument("--timeout-seconds", type=float, default=None,
                            help="an attempt running longer is timed out by the watchdog")
        parser.add_argument("--wait", action="store_true", help="follow until all are done")
        parser.add_argument("--wait-timeout", type=float, default=None,
                            help="stop following after this many seconds")
        parser.add_argument("--create-project", action="store_true",
                            help="create the project if it does not exist")

    def handle(self, *args, **opts):
        quiet_libraries(opts["verbosity"])
        inputs = self._inputs(opts)  # checked before anything is created
        resources = _resources(opts["resource"], opts["llm"])
        project = project_named(opts["project"], create=opts["create_project"])
        problem = services.agent_resources_problem(
            opts["agent"], resources or _latest_resources(project))
        if problem is not None:
            raise CommandError(f"agent {opts['agent']}: {problem}")
        resources_id = None
        if resources:
            try:
                version = store_services.resources_add(project=project, resources=resources)
            except StoreError as exc:
                raise CommandError(str(exc)) from None
            resources_id = version.resource_set.resources_id
        specs = [
            RolloutSpec(input=value, mode=opts["mode"], resources_id=resources_id, config={
                "max_attempts": opts["max_attempts"], "retry_condition": opts["retry_on"],
                "timeout_seconds": opts["timeout_seconds"],
            })
            for value in inputs
        ]
        embedded = settings.EMBEDDED_WORKERS
        with embedded_workers() if embedded else nullcontext():
            try:
                rollouts = services.rollouts_enqueue_for_celery(
                    project=project, specs=specs, agent=opts["agent"]
                )
            except StoreError as exc:
                raise CommandError(str(exc)) from None
            self.stdout.write(f"enqueued {len(rollouts)} rollouts for {opts['agent']}")
            if embedded or opts["wait"]:
                by_status = follow(project, [r.pk for r in rollouts], interval=0.5,
                                   timeout=opts["wait_timeout"],
                                   out=progress_stream(self.stdout))
                self.stdout.write(reward_line([r.pk for r in rollouts]))
                self.stdout.write(json.dumps(by_status, sort_keys=True))  # last: for scripts
                _fail_loudly(by_status, [r.pk for r in rollouts])
                _unfinished_loudly(by_status, project.name)

    def _inputs(self, opts) -> list:
        if opts["inputs_file"]:
            return _read_inputs(opts["inputs_file"])
        if opts["count"] < 1:
            raise CommandError("--count must be >= 1")
        if opts["input"] is not None:
            try:
                value = json.loads(opts["input"])
            except json.JSONDecodeError as exc:
                raise CommandError(f"--input is not JSON: {exc}") from None
            return [value] * opts["count"]
        return [{"index": i} for i in range(opts["count"])]


def _latest_resources(project) -> dict:
    latest = store_selectors.resources_latest(project=project)
    return dict(latest.resources) if latest is not None else {}


def _resources(items: list[str], llm_model: str | None) -> dict:
    """The resources named on the command line: `NAME=JSON` or `NAME=@file.json` (each an
    object), and `--llm MODEL` as a proxy_llm resource on the model gateway."""
    resources = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not name or not sep:
            raise CommandError(f"--resource {item!r}: expected NAME=JSON or NAME=@FILE")
        where = f"--resource {name}"
        if raw.startswith("@"):
            where = f"--resource {name}: {raw[1:]}"
            try:
                raw = Path(raw[1:]).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise CommandError(f"{where}: {getattr(exc, 'strerror', None) or exc}") from None
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise CommandError(f"{where}: not JSON ({exc.msg}, line {exc.lineno} column "
                               f"{exc.colno})") from None
        if not isinstance(value, dict):
            raise CommandError(f"{where}: a resource must be a JSON object, got "
                               f"{type(value).__name__}")
        resources[name] = value
    if llm_model:
        resources["llm"] = {"resource_type": PROXY_LLM, "endpoint": settings.LLM_GATEWAY_URL,
                            "model": llm_model}
    return resources


def _read_inputs(path: str) -> list:
    """The inputs of a JSON-lines file; a file that cannot be read, or a line that is not
    JSON, is one line naming the file (and the line)."""
    inputs = []
    try:
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    inputs.append(json.loads(line.rstrip("\r\n")))
                except json.JSONDecodeError as exc:
                    raise CommandError(f"--inputs-file {path}:{number}: not JSON ({exc.msg}, "
                                       f"column {exc.colno}); one JSON input per line") from None
    except OSError as exc:
        raise CommandError(f"--inputs-file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise CommandError(f"--inputs-file {path}: not UTF-8 text") from None
    if not inputs:
        raise CommandError(f"--inputs-file {path}: no inputs (one JSON input per line)")
    return inputs


def _fail_loudly(by_status: dict[str, int], rollout_ids: list[str]) -> None:
    """A batch with failed rollouts exits non-zero, with the first error."""
    failed = by_status.get("failed", 0)
    if failed:
        first = store_selectors.rollouts_first_error(rollout_ids=rollout_ids)
        raise CommandError(f"{failed} of {len(rollout_ids)} rollouts failed; first: {first}")


def _unfinished_loudly(by_status: dict[str, int], project: str) -> None:
    """A wait that ended (--wait-timeout) with rollouts not finished exits non-zero."""
    total = sum(by_status.values())
    unfinished = total - selectors.finished_count(by_status)
    if unfinished:
        open_counts = ", ".join(f"{status}={n}" for status, n in sorted(by_status.items())
                                if status not in ROLLOUT_TERMINAL)
        raise CommandError(f"the wait ended with {unfinished} of {total} rollouts not finished "
                           f"({open_counts}); see `queue_watch {project}`")

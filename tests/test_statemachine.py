import pytest

from store.errors import InvalidInput
from store.statemachine import (
    AttemptStatus as A,
)
from store.statemachine import (
    RolloutConfig,
    check_attempt_transition,
    check_rollout_transition,
    rollout_status_for_attempt,
)
from store.statemachine import (
    RolloutStatus as R,
)

RETRY = RolloutConfig(max_attempts=3, retry_condition=("failed", "timeout", "unresponsive"))


@pytest.mark.parametrize("status", [A.PREPARING, A.RUNNING, A.SUCCEEDED])
def test_rollout_copies_preparing_running_succeeded(status):
    assert rollout_status_for_attempt(status, 1, RolloutConfig()) == status


@pytest.mark.parametrize("status", [A.FAILED, A.TIMEOUT, A.UNRESPONSIVE])
def test_lost_attempt_requeues_when_retry_allows(status):
    assert rollout_status_for_attempt(status, 1, RETRY) == R.REQUEUING
    assert rollout_status_for_attempt(status, 2, RETRY) == R.REQUEUING


@pytest.mark.parametrize("status", [A.FAILED, A.TIMEOUT, A.UNRESPONSIVE])
def test_lost_attempt_fails_rollout_when_attempts_are_used_up(status):
    assert rollout_status_for_attempt(status, 3, RETRY) == R.FAILED


@pytest.mark.parametrize("status", [A.FAILED, A.TIMEOUT, A.UNRESPONSIVE])
def test_lost_attempt_fails_rollout_without_retry_condition(status):
    assert rollout_status_for_attempt(status, 1, RolloutConfig(max_attempts=5)) == R.FAILED


def test_retry_condition_is_per_status():
    config = RolloutConfig(max_attempts=3, retry_condition=("timeout",))
    assert rollout_status_for_attempt(A.TIMEOUT, 1, config) == R.REQUEUING
    assert rollout_status_for_attempt(A.FAILED, 1, config) == R.FAILED


def test_default_config_is_agl_default():
    config = RolloutConfig.parse({})
    assert config == RolloutConfig(None, None, 1, ())
    assert config.as_json() == {
        "timeout_seconds": None, "unresponsive_seconds": None, "max_attempts": 1,
        "retry_condition": [],
    }


@pytest.mark.parametrize("raw", [
    {"max_attempts": 0}, {"max_attempts": "2"}, {"timeout_seconds": -1},
    {"retry_condition": ["exploded"]}, {"bogus": 1}, [],
    {"timeout_seconds": 2.5e11}, {"unresponsive_seconds": 3.3e9},
    {"timeout_seconds": float("nan")}, {"unresponsive_seconds": float("inf")},
])
def test_bad_config_is_refused_with_the_field(raw):
    with pytest.raises(InvalidInput) as refused:
        RolloutConfig.parse(raw)
    if isinstance(raw, dict) and "seconds" in next(iter(raw)):
        assert refused.value.field == f"config.{next(iter(raw))}"


def test_the_longest_limit_is_accepted():
    assert RolloutConfig.parse({"timeout_seconds": 3.2e9}).timeout_seconds == 3.2e9


@pytest.mark.parametrize("current,requested", [
    (A.PREPARING, A.RUNNING), (A.PREPARING, A.SUCCEEDED), (A.RUNNING, A.FAILED),
    (A.TIMEOUT, A.SUCCEEDED), (A.UNRESPONSIVE, A.RUNNING), (A.UNRESPONSIVE, A.FAILED),
    (A.RUNNING, A.TIMEOUT), (A.RUNNING, A.UNRESPONSIVE),
])
def test_legal_attempt_moves(current, requested):
    assert check_attempt_transition(current, requested) is True


@pytest.mark.parametrize("current,requested", [
    (A.SUCCEEDED, A.FAILED), (A.FAILED, A.SUCCEEDED), (A.SUCCEEDED, A.RUNNING),
    (A.RUNNING, A.PREPARING), (A.TIMEOUT, A.RUNNING),
])
def test_illegal_attempt_moves(current, requested):
    with pytest.raises(ValueError):
        check_attempt_transition(current, requested)


def test_same_status_is_a_no_op():
    assert check_attempt_transition(A.RUNNING, A.RUNNING) is False
    assert check_rollout_transition(R.CANCELLED, R.CANCELLED) is False


@pytest.mark.parametrize("terminal", [R.SUCCEEDED, R.FAILED, R.CANCELLED])
def test_terminal_rollouts_stay_terminal(terminal):
    for other in R.values:
        if other != terminal:
            with pytest.raises(ValueError):
                check_rollout_transition(terminal, other)

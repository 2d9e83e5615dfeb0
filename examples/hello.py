"""The smallest agent: reads its task, records a message, and returns a reward (returning a
number is how a plain function reports its reward). Try it on the embedded default:

    ./lightning rollouts_enqueue hello --create-project --agent examples.hello:agent --count 20
"""

from __future__ import annotations

from typing import Any

from runners.tracing import emit_message


def agent(task: Any) -> float:
    index = task.get("index", 0) if isinstance(task, dict) else 0
    emit_message(f"hello from task {index}")
    # Half the tasks succeed: the summary's mean reward is 0.5 for an even --count.
    return 1.0 if index % 2 == 0 else 0.0

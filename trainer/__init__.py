"""The algorithm side. `from trainer import fit` is the Python entry point (trainer/fitting.py),
loaded on first use so that importing the app stays cheap."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "fit":
        from trainer.fitting import fit

        return fit
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")

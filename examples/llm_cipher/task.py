"""The recall task: answer the letter a digit stands for, behind a line of noise.

A prompt is a few noise letters and a digit, e.g. "qzt 7"; the right answer is the letter
`SECRET[digit]`, one of `LETTERS`, a code the model is never told. The reward is 1 for exactly
the right letter, else 0 (verifiable). Training and validation prompts share the digits but
not the noise: validation measures the learned code on prompts never trained on.
"""

from __future__ import annotations

import random
import string

LETTERS = "ABCDE"
DIGITS = "0123456789"
# The hidden code the agent must discover: each digit stands for one letter.
# Every letter stands for two digits, so no single guess scores better than 1/len(LETTERS).
SECRET = dict(zip(DIGITS, random.Random(11).sample(LETTERS * 2, len(DIGITS)), strict=True))
NOISE = 3  # noise letters before the digit
ALPHABET = string.ascii_lowercase + string.ascii_uppercase + string.digits + " .:?!-"


def prompt(task: dict) -> str:
    return f"{task['noise']} {task['digit']}"


def reward(task: dict, reply: str) -> float:
    return 1.0 if reply.strip() == SECRET[task["digit"]] else 0.0


def make_dataset(size: int, *, seed: int, held_out: bool = False) -> list[dict[str, str]]:
    """`size` tasks; noise words start with a-m for training and n-z for validation."""
    rng = random.Random(seed)
    first = string.ascii_lowercase[13:] if held_out else string.ascii_lowercase[:13]
    tasks = []
    for i in range(size):
        noise = rng.choice(first) + "".join(rng.choices(string.ascii_lowercase, k=NOISE - 1))
        tasks.append({"noise": noise, "digit": DIGITS[i % len(DIGITS)]})
    return tasks

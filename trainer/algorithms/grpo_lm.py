"""grpo_lm: GRPO on the token ids the model gateway recorded, for Hugging Face causal LMs.

Each step runs `group_size` rollouts of `tasks_per_step` tasks against the current checkpoint
(served by the gateway); every LLM call of a rollout becomes a sample (token_adapter.py) with
its rollout's reward. Advantages are group-relative (reward minus the group's mean, divided by
its spread; groups with one reward carry no signal). The loss is PPO's clipped objective per
generated token against the log-probabilities recorded at generation time, averaged over
tokens, plus `kl_coef` times a KL estimate to the initial model when set; micro-batches of
`micro_batch` samples accumulate gradients into one optimizer step per epoch. On CUDA when the
training worker has it.

`model` is anything trainer/llm/models.py resolves: a Hugging Face directory, a known name
(`smollm2`), a GGUF file, a model id in the local Hugging Face cache. With `lora: {r, alpha,
dropout, target_modules}` (trainer/llm/lora.py) a step trains a LoRA adapter only, and a
checkpoint is the adapter (+ optimizer state, + the base model's sha256: it loads onto no other
base); without it every weight is trained.

The PPO ratio compares log-probabilities of the distribution the gateway sampled from
(trainer/llm/sampling.py: the call's temperature and top_p, greedy = argmax) in float32: the
recorded ones where the span says the engine computed them so ("sampled:float32"), else (an
upstream server, a bfloat16 engine) they are recomputed with the step's starting weights before
the first update (metric `recomputed_samples`). So the ratio is 1 at the first epoch.

A checkpoint is a directory (`save_pretrained`: safetensors weights, config, tokenizer, plus
the optimizer's state; or the LoRA adapter) stored through the checkpoint storage; each one is
published both as the job's `checkpoint` resource and as its `llm` resource (the gateway's
endpoint, the model's name and the version), which the next step's rollouts pin.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer import checkpoints, distributed
from trainer.algorithms.adapter import FinishedRollout
from trainer.algorithms.base import Algorithm, PlannedRollout, Update, step_seed
from trainer.algorithms.grpo import group_advantages, plan_groups
from trainer.algorithms.token_adapter import TokenAdapter, TokenSample
from trainer.llm import lora as lora_
from trainer.llm import models, sampling

log = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "group_size": 8,
    "tasks_per_step": 8,
    "epochs": 2,
    "clip": 0.2,
    "kl_coef": 0.0,
    "micro_batch": 64,
    "max_grad_norm": 1.0,
    # asynchronous jobs (max_staleness > 0): the truncation of the per-token importance
    # weight pi_prox / pi_behaviour (see `off_policy_correct`)
    "importance_cap": 2.0,
    "val_every": 1,
    # What agents are asked to use (the `llm` resource's sampling_parameters).
    "sampling_parameters": {"temperature": 1.0, "max_tokens": 16},
}
OPTIMIZER_FILE = "optimizer.pt"
# Recorded logprobs used as they are: the engine's, of the sampled distribution, in float32.
RECORDED_EXACT = f"{sampling.SAMPLED}:float32"
# A common prefix at least this long is computed once per micro-batch (_logits).
SHARED_MIN = 16


class GRPOLM(Algorithm):
    serves_llm = True
    # world_size > 1: DDP over the trainable parameters (the LoRA adapter's, or every weight);
    # each rank trains on its contiguous shard of the samples (trainer/distributed.py).
    runs_ddp = True

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__({**DEFAULTS, **config})
        if not self.config.get("model"):
            raise ValueError("grpo_lm needs config['model']: a checkpoint directory in Hugging "
                             "Face format, a model id in the local Hugging Face cache, a GGUF "
                             "file or an installed name such as smollm2")
        self.token_adapter = TokenAdapter(aggregation=self.config.get("aggregation",
                                                                      "transition"))
        self.lora = (lora_.settings(self.config["lora"])
                     if self.config.get("lora") is not None else None)

    @property
    def base(self) -> str:
        """The job's `model` as a LoRA adapter records it (a path made absolute)."""
        model = str(self.config["model"])
        return str(Path(model).resolve()) if Path(model).exists() else model

    # --- checkpoints: directories, not torch.save payloads ------------------------------------
    def init_state(self) -> dict[str, Any]:
        if self.lora is None:
            return {"dir": str(models.resolve(self.config["model"])), "owned": False}
        import torch

        base, _, sha = lora_.load_base(self.base)
        torch.manual_seed(step_seed(self.seed, 0))
        out = Path(tempfile.mkdtemp(prefix="grpo_lm-lora-"))
        lora_.save_adapter(lora_.new_adapter(base, self.lora), out, base=self.base, sha=sha)
        return {"dir": str(out), "owned": True}

    def save(self, state: dict[str, Any], *, name_prefix: str, step: int,
             metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            return checkpoints.checkpoint_save_dir(directory=state["dir"],
                                                   name_prefix=name_prefix, step=step,
                                                   metrics=metrics)
        finally:
            if state.get("owned"):
                shutil.rmtree(state["dir"], ignore_errors=True)

    def load(self, resource: dict[str, Any]) -> dict[str, Any]:
        return {"dir": str(checkpoints.checkpoint_local_dir(resource)), "owned": False}

    def published_resources(self, checkpoint: dict[str, Any], *, job_id: int) -> dict[str, Any]:
        from django.conf import settings

        return {"llm": {
            "resource_type": "proxy_llm",
            "endpoint": settings.LLM_GATEWAY_URL,
            "model": str(self.config.get("model_name") or f"job-{job_id}"),
            "sampling_parameters": dict(self.config["sampling_parameters"]),
            "version": int(checkpoint["step"]),
            "checkpoint": {k: v for k, v in checkpoint.items() if k != "metrics"},
        }}

    # --- the loop -----------------------------------------------------------------------------
    def plan(self, *, step: int, final: bool, train_dataset: Sequence[Any],
             val_dataset: Sequence[Any]) -> list[PlannedRollout]:
        return plan_groups(self.config, self.seed, step=step, final=final,
                           train_dataset=train_dataset, val_dataset=val_dataset)

    def samples(self, rollouts: Sequence[FinishedRollout]) -> list[TokenSample]:  # type: ignore[override]
        return [
            sample for rollout in rollouts if rollout.mode == "train" and rollout.succeeded
            for sample in self.token_adapter.samples(rollout)
        ]

    def update(self, *, step: int, state: dict[str, Any], samples: list[Any],
               device: str) -> Update:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from trainer.llm.server import quiet_transformers

        quiet_transformers()
        torch.manual_seed(step_seed(self.seed, step))
        if self.lora is None:
            model = AutoModelForCausalLM.from_pretrained(state["dir"], dtype=torch.float32)
        else:
            base, _, sha = lora_.load_base(self.base)
            lora_.check_base(state["dir"], sha, self.base)
            model = lora_.load_adapter(base, state["dir"], trainable=True)
        model.to(device)
        # No dropout: the ratio must compare the same function the gateway sampled from (a
        # LoRA `dropout` > 0 is the exception, on the adapter's input only).
        model.eval()
        for name, module in model.named_modules():
            if name.split(".")[-1] == "lora_dropout":
                module.train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.Adam(params, lr=float(self.config["lr"]))
        saved = Path(state["dir"]) / OPTIMIZER_FILE
        if saved.exists():
            optimizer.load_state_dict(torch.load(saved, map_location=device, weights_only=True))
        reference = None
        if float(self.config["kl_coef"]) > 0 and self.lora is None:
            reference = AutoModelForCausalLM.from_pretrained(models.resolve(self.base))
            reference.to(device).eval()
        elif float(self.config["kl_coef"]) > 0:
            reference = model  # the base: the same model with its adapter disabled
        advantages = group_advantages(samples)
        trained = [s for s in samples if s.rollout_id in advantages]
        metrics: dict[str, Any] = {"samples": len(samples), "trained_samples": len(trained),
                                   "trained_tokens": sum(s.generated for s in trained)}
        stale = [s for s in samples if s.version is not None and s.version != step]
        if stale:
            metrics["off_policy_samples"] = len(stale)
        # per generated token, the checkpoint that produced it (partial rollouts: several)
        made_by = [v for s in trained for v, m in zip(s.versions or [], s.mask, strict=False)
                   if m and v is not None]
        if made_by:
            metrics["stale_token_fraction"] = sum(1 for v in made_by if v != step) / len(made_by)
        size = int(self.config["micro_batch"])
        rank, world_size = distributed.world()
        start, stop = distributed.shard_bounds(len(trained), rank, world_size)
        mine = trained[start:stop]
        batches = [_tensors(mine[i:i + size], advantages, device)
                   for i in range(0, len(mine), size)]
        if world_size > 1 and trained:
            # Every rank runs as many forward/backward passes (DDP all-reduces on each
            # synchronised backward): a shorter shard pads with passes that weigh nothing.
            passes = max(-(-(b - a) // size) for a, b in
                         (distributed.shard_bounds(len(trained), r, world_size)
                          for r in range(world_size)))
            blank = _blank(_tensors((mine or trained)[:1], advantages, device))
            batches += [blank] * (passes - len(batches))
        recomputed = sum(_fill_old(model, batch) for batch in batches)
        recomputed = int(distributed.all_sum([float(recomputed)], device)[0])
        if recomputed:
            metrics["recomputed_samples"] = recomputed
        if batches and int(self.config.get("max_staleness") or 0) > 0:
            metrics.update(off_policy_correct(model, batches,
                                              float(self.config["importance_cap"])))
        # The loss is the mean over the global batch's generated tokens, at any world size.
        total_tokens = float(sum(s.generated for s in trained))
        trainer = distributed.wrap(model)  # DDP in a process group; else the model itself
        for _ in range(int(self.config["epochs"]) if trained else 0):
            metrics.update(self._epoch(trainer, model, reference, optimizer, params, batches,
                                       total_tokens))
        if rank != 0:  # rank 0's update is the step's (distributed.update); write nothing
            return Update(state=None, metrics=metrics)
        out = Path(tempfile.mkdtemp(prefix="grpo_lm-"))
        if self.lora is None:
            model.save_pretrained(out)
            AutoTokenizer.from_pretrained(state["dir"]).save_pretrained(out)
        else:
            lora_.save_adapter(model, out, base=self.base, sha=sha)
        torch.save(optimizer.state_dict(), out / OPTIMIZER_FILE)
        return Update(state={"dir": str(out), "owned": True}, metrics=metrics)

    def _epoch(self, trainer: Any, model: Any, reference: Any, optimizer: Any,
               params: list[Any], batches: list[dict[str, Any]],
               total_tokens: float) -> dict[str, float]:
        """One optimizer step over `batches` (this rank's); `trainer` is `model` under DDP
        in a process group (gradients all-reduced on the last backward), else `model`."""
        import contextlib

        import torch

        clip, kl_coef = float(self.config["clip"]), float(self.config["kl_coef"])
        _, world_size = distributed.world()
        optimizer.zero_grad()
        sums = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "ratio": 0.0}
        for index, batch in enumerate(batches):
            last = index == len(batches) - 1
            sync = (trainer.no_sync() if trainer is not model and not last
                    else contextlib.nullcontext())
            with sync:
                self._micro_batch(trainer, model, reference, params, batch, total_tokens,
                                  world_size, clip, kl_coef, sums)
        torch.nn.utils.clip_grad_norm_(params, float(self.config["max_grad_norm"]))
        optimizer.step()
        loss, clipped, ratio, kl = distributed.all_sum(
            [sums["loss"], sums["clip_fraction"], sums["ratio"], sums["kl"]],
            params[0].device)
        return {"loss": loss, "clip_fraction": clipped / total_tokens,
                "mean_ratio": ratio / total_tokens,
                **({"kl": kl / total_tokens} if reference is not None else {})}

    def _micro_batch(self, trainer: Any, model: Any, reference: Any, params: list[Any],
                     batch: dict[str, Any], total_tokens: float, world_size: int, clip: float,
                     kl_coef: float, sums: dict[str, float]) -> None:
        import contextlib

        import torch

        new = _token_logprobs(trainer, batch)
        mask = batch["mask"]
        ratio = torch.exp(new - batch["old"])
        adv = batch["advantage"].unsqueeze(1)
        surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
        if "weights" in batch:  # an asynchronous job's tokens (off_policy_correct)
            surrogate = surrogate * batch["weights"]
        per_token = -surrogate
        if reference is not None:
            base_only = (reference.disable_adapter() if reference is model
                         else contextlib.nullcontext())
            with torch.no_grad(), base_only:
                ref = _token_logprobs(reference, batch)
            # k3 estimator of KL(pi || pi_ref): non-negative, unbiased.
            kl = torch.exp(ref - new) - (ref - new) - 1
            per_token = per_token + kl_coef * kl
            sums["kl"] += float((kl * mask).sum().detach())
        loss = (per_token * mask).sum() / total_tokens
        if trainer is not model:
            # DDP averages gradients over the ranks: scaled by world_size, the sum is the
            # global batch's. Every rank must run its backward (the all-reduce waits for
            # each); greedy rows carry no gradient (sampling.py), so zero-weight terms make
            # every trainable parameter take part.
            scaled = loss * world_size
            if not scaled.requires_grad:
                scaled = scaled + sum(p.sum() for p in params) * 0.0
            scaled.backward()
        elif loss.requires_grad:  # greedy samples alone carry no gradient (sampling.py)
            loss.backward()
        sums["loss"] += float(loss.detach())
        sums["clip_fraction"] += float((((ratio - 1).abs() > clip).float() * mask).sum())
        sums["ratio"] += float((ratio.detach() * mask).sum())


def _tensors(samples: list[TokenSample], advantages: dict[str, float],
             device: str) -> dict[str, Any]:
    """Right-padded ids, attention and loss masks, recorded logprobs, advantages, and each
    row's sampling settings (which rows' logprobs to recompute: `recompute`)."""
    import torch

    width = max(len(s.input_ids) for s in samples)

    def pad(rows: list[list], value: Any) -> list[list]:
        return [row + [value] * (width - len(row)) for row in rows]

    return {
        "ids": torch.tensor(pad([s.input_ids for s in samples], 0), device=device),
        "shared": _shared_prefix([s.input_ids for s in samples]),
        "attention": torch.tensor(pad([[1] * len(s.input_ids) for s in samples], 0),
                                  device=device),
        "mask": torch.tensor(pad([s.mask for s in samples], 0), dtype=torch.float32,
                             device=device),
        "old": torch.tensor(pad([s.old_logprobs for s in samples], 0.0), device=device),
        "advantage": torch.tensor([advantages[s.rollout_id] for s in samples], device=device),
        "sampling": [(s.temperature, s.top_p) for s in samples],
        "recompute": [s.logprobs_of != RECORDED_EXACT for s in samples],
    }


def _shared_prefix(rows: list[list[int]]) -> int:
    """How many leading ids every row has in common (leaving each row at least one more):
    the system prompt, tools and examples an agent sends with every call, often most of it."""
    if len(rows) < 2:
        return 0
    limit = min(len(r) for r in rows) - 1
    first = rows[0]
    for k in range(max(limit, 0)):
        if any(r[k] != first[k] for r in rows[1:]):
            return k
    return max(limit, 0)


def _blank(batch: dict[str, Any]) -> dict[str, Any]:
    """`batch` weighing nothing (no token in the loss, advantage 0): the padding pass of a
    rank whose shard has fewer micro-batches than another's."""
    return {**batch, "mask": batch["mask"] * 0, "advantage": batch["advantage"] * 0,
            "recompute": [False] * len(batch["recompute"])}


def _fill_old(model: Any, batch: dict[str, Any]) -> int:
    """Recompute the `old` logprobs of the rows whose recorded ones are not exact (see the
    module docstring) with the weights before the first update; returns how many rows."""
    import torch

    rows = [i for i, redo in enumerate(batch["recompute"]) if redo]
    if rows:
        with torch.no_grad():
            batch["old"][rows] = _token_logprobs(model, batch)[rows] * batch["mask"][rows]
    return len(rows)


def off_policy_correct(model: Any, batches: list[dict[str, Any]], cap: float
                       ) -> dict[str, float]:
    """Decoupled PPO per token, as `grpo.off_policy_correct`: the ratio is taken against the
    proximal policy (the weights the step starts from, computed here before the first
    update) and each generated token's objective is weighted by pi_prox / pi_behaviour of
    its recorded log-probability, truncated at `cap`. Rewrites each batch's `old` and sets
    its `weights`; returns the weights' statistics over generated tokens."""
    import torch

    total = truncated = 0.0
    weight_sum, weight_max = 0.0, 0.0
    for batch in batches:
        mask = batch["mask"]
        with torch.no_grad():
            proximal = _token_logprobs(model, batch) * mask
        raw = torch.exp(proximal - batch["old"]) * mask
        batch["weights"] = raw.clamp(max=cap)
        batch["old"] = proximal
        total += float(mask.sum())
        truncated += float(((raw > cap).float() * mask).sum())
        weight_sum += float((batch["weights"] * mask).sum())
        weight_max = max(weight_max, float(raw.max()))
    return {"is_weight_mean": weight_sum / max(total, 1.0), "is_weight_max": weight_max,
            "is_weight_truncated_fraction": truncated / max(total, 1.0)}


def _logits(model: Any, batch: dict[str, Any]) -> Any:
    """The model's logits at every position of every row. Rows that start with the same ids
    (`shared`, at least SHARED_MIN) run that prefix once, with batch size 1, and the rest of
    each row on top of its key/value cache repeated per row: the same logits (to float
    rounding: tests/llm/test_ratio.py) and the same gradients, for one prefix's compute
    instead of one per row."""
    import torch

    ids, attention, shared = batch["ids"], batch["attention"], batch.get("shared", 0)
    if shared < SHARED_MIN:
        return model(input_ids=ids, attention_mask=attention).logits
    head = model(input_ids=ids[:1, :shared], attention_mask=attention[:1, :shared],
                 use_cache=True)
    cache = getattr(head, "cache", None) or head.past_key_values
    cache.batch_repeat_interleave(ids.shape[0])
    name = "cache" if "cache" in _forward_params(model) else "past_key_values"
    tail = model(input_ids=ids[:, shared:], attention_mask=attention, use_cache=True,
                 **{name: cache})
    return torch.cat([head.logits.expand(ids.shape[0], -1, -1), tail.logits], dim=1)


def _forward_params(model: Any) -> Any:
    import inspect

    inner = getattr(model, "module", model)  # under DDP (trainer/distributed.py), its model
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    return inspect.signature(inner.forward).parameters


def _token_logprobs(model: Any, batch: dict[str, Any]) -> Any:
    """log pi(token_t | tokens_<t) at every position (0 at the first, which has no context)."""
    import torch

    logits = _logits(model, batch)
    logp = torch.stack([sampling.logprobs(logits[i, :-1], temperature, top_p)
                        for i, (temperature, top_p) in enumerate(batch["sampling"])])
    taken = logp.gather(2, batch["ids"][:, 1:].unsqueeze(2)).squeeze(2).clamp(min=-1e9)
    return torch.cat([torch.zeros_like(taken[:, :1]), taken], dim=1)

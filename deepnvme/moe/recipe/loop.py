"""The recipe's training loop on one rank: data, model, DP + EP gradient reduction, eval, MoS, checkpoints.

What DeepSpeed's engine does for an MoE model is done here with plain torch.distributed, so the recipe runs on
any gloo/NCCL setup: deepnvme.moe's layers create their expert-parallel groups when built (after
init_process_group), and allreduce_moe_gradients averages dense gradients over all ranks and expert
gradients over the ranks holding the same experts.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from deepnvme.moe.checkpoint import load_moe_checkpoint, save_moe_checkpoint
from deepnvme.moe.recipe.distill import mos_loss
from deepnvme.moe.recipe.gpt import GPT, GPTConfig, count_parameters
from deepnvme.moe.recipe.settings import Teacher, TrainSettings
from deepnvme.moe.recipe.synthetic import TopicTask


def _lr(s: TrainSettings, it: int) -> float:
    """Linear warm-up, then cosine decay to min_lr at the last iteration."""
    if it < s.lr_warmup_iters:
        return s.lr * (it + 1) / s.lr_warmup_iters
    span = max(1, s.train_iters - s.lr_warmup_iters)
    progress = min(1.0, (it - s.lr_warmup_iters) / span)
    return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1 + math.cos(math.pi * progress))


def build_model(cfg: GPTConfig, seed: int) -> GPT:
    """The GPT of `cfg` on this rank: its share of the experts, groups set up (needs an initialised group)."""
    return GPT(cfg, seed=seed)


def _teacher(t: Teacher) -> GPT:
    """The trained teacher of MoS, at this run's ep size (its config was read and checked beforehand)."""
    teacher = build_model(GPTConfig(**t.config), seed=0)
    load_moe_checkpoint(teacher, t.path)
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


@torch.no_grad()
def evaluate(model: GPT, batches: list[torch.Tensor]) -> float:
    """Mean next-token cross-entropy over every rank's validation batches (all ranks call it together)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for batch in batches:
        logits, _ = model(batch[:, :-1])
        total[0] += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").double()
        total[1] += batch[:, 1:].numel()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    model.train(was_training)
    return float(total[0] / total[1])


def validation_batches(task: TopicTask, s: TrainSettings, rank: int, world: int) -> list[torch.Tensor]:
    """This rank's share of one fixed validation set (the same set at every world size that divides it)."""
    g = torch.Generator().manual_seed(task.seed + 7919)
    table = task.table()
    every = [task.batch(s.micro_batch_size, g, table) for _ in range(s.eval_iters * world)]
    return every[rank::world]


def run_worker(rank: int, world: int, s: TrainSettings, init_method: str | None) -> dict[str, Any]:
    """Train on this rank; rank 0 writes log_json; returns the results (every rank)."""
    torch.set_num_threads(s.threads or max(1, (os.cpu_count() or 1) // world))
    if init_method is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        return train(rank, world, s)
    finally:
        from deepnvme.moe.groups import reset_groups

        dist.destroy_process_group()
        reset_groups()


def train(rank: int, world: int, s: TrainSettings) -> dict[str, Any]:
    """Train on this rank of an initialised process group; rank 0 writes log_json; returns the results."""
    from deepnvme.moe import (
        allreduce_moe_gradients,
        broadcast_moe_parameters,
        split_params_into_different_moe_groups_for_optimizer,
    )

    task, cfg = s.task, s.model
    # Routing noise (RTS, sampling) draws from the global RNG: seeded, and different per rank like the data.
    torch.manual_seed(s.seed * 1000 + rank)
    model = build_model(cfg, s.seed)
    if s.load:
        load_moe_checkpoint(model, s.load)
    # The init is already the same on every rank (seeded by name); the broadcast is DeepSpeed's guarantee.
    broadcast_moe_parameters(model)
    teacher = _teacher(s.teacher) if s.teacher else None
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": [p for p in model.parameters() if p.requires_grad], "name": "dense"}]
    )
    optimizer = torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95), weight_decay=s.weight_decay)

    table = task.table()
    data = torch.Generator().manual_seed(s.seed * 1000 + 17 + rank)
    val = validation_batches(task, s, rank, world)
    curve: list[dict[str, float]] = []
    start = time.perf_counter()
    running = torch.zeros(3, dtype=torch.float64)  # lm loss sum, aux loss sum, steps

    def record(it: int) -> None:
        nonlocal running
        if world > 1:
            dist.all_reduce(running)
        steps = float(running[2])
        point = {
            "iter": it,
            "val_loss": evaluate(model, val),
            "elapsed_s": time.perf_counter() - start,
            # means since the last point (none before the first step)
            "train_loss": float(running[0]) / steps if steps else None,
            "aux_loss": float(running[1]) / steps if steps else None,
        }
        curve.append(point)
        running = torch.zeros(3, dtype=torch.float64)
        if rank == 0:
            train_part = f"train {point['train_loss']:.4f}  aux {point['aux_loss']:.3f}  " if steps else ""
            print(f"iter {it:5d}  val {point['val_loss']:.4f}  {train_part}{point['elapsed_s']:.0f} s",
                  flush=True)

    record(0)
    model.train()
    for it in range(s.train_iters):
        for group in optimizer.param_groups:
            group["lr"] = _lr(s, it)
        batch = task.batch(s.micro_batch_size, data, table)
        logits, aux = model(batch[:, :-1])
        lm = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss = lm + s.moe_loss_coeff * aux
        kd = s.teacher
        if teacher is not None and kd is not None and (kd.stop_iter is None or it < kd.stop_iter):
            with torch.no_grad():
                teacher_logits, _ = teacher(batch[:, :-1])
            loss = (
                kd.alpha_ce * lm
                + kd.beta_ce * mos_loss(logits, teacher_logits, kd.temperature)
                + s.moe_loss_coeff * aux
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        allreduce_moe_gradients(model)
        optimizer.step()
        running += torch.tensor([lm.item(), aux.item(), 1.0], dtype=torch.float64)
        if (it + 1) % s.eval_interval == 0 or it + 1 == s.train_iters:
            record(it + 1)

    results = {
        "config": cfg.to_dict(),
        "task": asdict(task),
        "world_size": world,
        "params": count_parameters(model),
        "loss_floor": task.loss_floor(),
        "curve": curve,
        "final_val_loss": curve[-1]["val_loss"],
        "mos": s.teacher is not None,
        "train_s": time.perf_counter() - start,
    }
    if s.save:
        save_moe_checkpoint(
            model,
            s.save,
            f"global_step{s.train_iters}",
            {"gpt_config": cfg.to_dict(), "task": asdict(task), "iteration": s.train_iters},
        )
    if rank == 0 and s.log_json:
        os.makedirs(os.path.dirname(os.path.abspath(s.log_json)), exist_ok=True)
        with open(s.log_json, "w") as f:
            json.dump(results, f, indent=1)
    return results

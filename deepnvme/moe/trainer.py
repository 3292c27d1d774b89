"""The recipe's training loop on one rank: data, model, DP + EP gradient reduction, eval, MoS, checkpoints.

What DeepSpeed's engine does for an MoE model is done here with plain torch.distributed, so the recipe runs on
any gloo/NCCL setup: deepnvme.moe's layers create their expert-parallel groups when built (after
init_process_group), and allreduce_moe_gradients averages dense gradients over all ranks and expert
gradients over the ranks holding the same experts.
"""

from __future__ import annotations

import argparse
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
from deepnvme.moe.distill import mos_loss
from deepnvme.moe.gpt import GPT, GPTConfig, count_parameters
from deepnvme.moe.synthetic import TopicTask
from deepnvme.moe.train import model_config, task_from_args


def _lr(args: argparse.Namespace, it: int) -> float:
    """Linear warm-up, then cosine decay to --min-lr at the last iteration."""
    if it < args.lr_warmup_iters:
        return args.lr * (it + 1) / args.lr_warmup_iters
    span = max(1, args.train_iters - args.lr_warmup_iters)
    progress = min(1.0, (it - args.lr_warmup_iters) / span)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


def build_model(cfg: GPTConfig, seed: int) -> GPT:
    """The GPT of `cfg` on this rank: its share of the experts, groups set up (needs an initialised group)."""
    return GPT(cfg, seed=seed)


def _teacher(args: argparse.Namespace) -> GPT:
    """The trained teacher of MoS, at this run's ep size (parse_args read and checked its config)."""
    teacher = build_model(GPTConfig(**args.teacher_config), seed=0)
    load_moe_checkpoint(teacher, args.load_teacher)
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


def validation_batches(
    task: TopicTask, args: argparse.Namespace, rank: int, world: int
) -> list[torch.Tensor]:
    """This rank's share of one fixed validation set (the same set at every world size that divides it)."""
    g = torch.Generator().manual_seed(args.task_seed + 7919)
    table = task.table()
    every = [task.batch(args.micro_batch_size, g, table) for _ in range(args.eval_iters * world)]
    return every[rank::world]


def run_worker(rank: int, world: int, args: argparse.Namespace, init_method: str | None) -> dict[str, Any]:
    """Train on this rank; rank 0 writes --log-json; returns the results (every rank)."""
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    if init_method is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        return train(rank, world, args)
    finally:
        from deepnvme.moe.groups import reset_groups

        dist.destroy_process_group()
        reset_groups()


def train(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train on this rank of an initialised process group; rank 0 writes --log-json; returns the results."""
    from deepnvme.moe import (
        allreduce_moe_gradients,
        broadcast_moe_parameters,
        split_params_into_different_moe_groups_for_optimizer,
    )

    task = task_from_args(args)
    cfg = model_config(args, task.vocab_size)
    # Routing noise (RTS, sampling) draws from the global RNG: seeded, and different per rank like the data.
    torch.manual_seed(args.seed * 1000 + rank)
    model = build_model(cfg, args.seed)
    if args.load:
        load_moe_checkpoint(model, args.load)
    # The init is already the same on every rank (seeded by name); the broadcast is DeepSpeed's guarantee.
    broadcast_moe_parameters(model)
    teacher = _teacher(args) if args.mos else None
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": [p for p in model.parameters() if p.requires_grad], "name": "dense"}]
    )
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)

    table = task.table()
    data = torch.Generator().manual_seed(args.seed * 1000 + 17 + rank)
    val = validation_batches(task, args, rank, world)
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
    for it in range(args.train_iters):
        for group in optimizer.param_groups:
            group["lr"] = _lr(args, it)
        batch = task.batch(args.micro_batch_size, data, table)
        logits, aux = model(batch[:, :-1])
        lm = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss = lm + args.moe_loss_coeff * aux
        if teacher is not None and (args.kd_stop_iter is None or it < args.kd_stop_iter):
            with torch.no_grad():
                teacher_logits, _ = teacher(batch[:, :-1])
            loss = (
                args.kd_alpha_ce * lm
                + args.kd_beta_ce * mos_loss(logits, teacher_logits, args.kd_temp)
                + args.moe_loss_coeff * aux
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        allreduce_moe_gradients(model)
        optimizer.step()
        running += torch.tensor([lm.item(), aux.item(), 1.0], dtype=torch.float64)
        if (it + 1) % args.eval_interval == 0 or it + 1 == args.train_iters:
            record(it + 1)

    results = {
        "config": cfg.to_dict(),
        "task": asdict(task),
        "world_size": world,
        "params": count_parameters(model),
        "loss_floor": task.loss_floor(),
        "curve": curve,
        "final_val_loss": curve[-1]["val_loss"],
        "mos": bool(args.mos),
        "train_s": time.perf_counter() - start,
    }
    if args.save:
        save_moe_checkpoint(
            model,
            args.save,
            f"global_step{args.train_iters}",
            {"gpt_config": cfg.to_dict(), "task": asdict(task), "iteration": args.train_iters},
        )
    if rank == 0 and args.log_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.log_json)), exist_ok=True)
        with open(args.log_json, "w") as f:
            json.dump(results, f, indent=1)
    return results

"""What one training run needs, as values: the model, the task, the optimiser schedule, the teacher.

The training loop (:mod:`.loop`) takes a :class:`TrainSettings` and nothing else, so it can be driven from
Python as well as from the command line (:mod:`.cli` turns flags into one). Every field is a plain value or
dataclass, so the settings pickle to spawned ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepnvme.moe.recipe.gpt import GPTConfig
from deepnvme.moe.recipe.synthetic import TopicTask

__all__ = ["Teacher", "TrainSettings"]


@dataclass(frozen=True)
class Teacher:
    """Mixture-of-Students: a trained teacher the run learns from (Megatron-DeepSpeed's --kd-* flags)."""

    path: str  # the teacher's checkpoint folder
    config: dict[str, Any]  # its GPTConfig fields, at this run's expert-parallel size
    temperature: float = 1.0
    alpha_ce: float = 1.0  # weight of the language-model loss
    beta_ce: float = 1.0  # weight of the distillation loss
    stop_iter: int | None = None  # staged KD: language-model loss only from this iteration on


@dataclass(frozen=True)
class TrainSettings:
    """One run: the model and task, the schedule, checkpoints, and where the curve goes."""

    model: GPTConfig
    task: TopicTask
    train_iters: int = 600
    micro_batch_size: int = 32  # sequences per rank and step
    lr: float = 3e-3
    min_lr: float = 3e-4
    lr_warmup_iters: int = 50
    weight_decay: float = 0.0
    moe_loss_coeff: float = 0.1  # weight of the summed aux losses
    seed: int = 1234  # weights, training batches and routing noise
    eval_interval: int = 50
    eval_iters: int = 8  # validation batches per rank
    save: str | None = None  # checkpoint folder written at the end
    load: str | None = None  # checkpoint folder to start from
    teacher: Teacher | None = None
    threads: int | None = None  # torch threads per process (default: the cores shared among the ranks)
    log_json: str | None = None  # rank 0 writes the curve and figures here

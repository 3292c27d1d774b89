"""Mixture-of-Students (MoS): the distillation loss a smaller student learns from a trained MoE teacher."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mos_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """T² · KL(teacher ‖ student) of the temperature-softened distributions, averaged over tokens.

    The same quantity as Megatron-DeepSpeed's MoS loss (batchmean KL divided by the sequence length); the
    T² keeps the gradient scale independent of the temperature. The teacher's logits carry no gradient.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ in shape"
        )
    vocab = student_logits.shape[-1]
    s = F.log_softmax(student_logits.float().reshape(-1, vocab) / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.detach().float().reshape(-1, vocab) / temperature, dim=-1)
    return F.kl_div(s, t, reduction="batchmean", log_target=True) * temperature**2

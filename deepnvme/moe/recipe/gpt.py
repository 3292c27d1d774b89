"""A small GPT (causal transformer, pure torch) with DeepSpeed-style MoE layers every few blocks.

The model layout follows Megatron-DeepSpeed's NLG recipe: 1-based block l is an MoE block iff
l % expert_interval == 0, and takes num_experts[(l - 1) // expert_interval] experts, so a list gives the
pyramid of PR-MoE (more experts near the output). A block with one expert is a plain dense MLP, as there.
`mlp_type="residual"` turns every MoE block into PR-MoE's residual form (a dense MLP beside the experts).

Initial weights depend only on the seed and each parameter's global name (an expert's global id, not its
rank-local slot), so the same seed gives the same model at every expert-parallel size and every expert
starts different from the others (DeepSpeed's experts start as identical copies).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepnvme._core.checks import check_int, check_positive_number
from deepnvme.moe.experts import EXPERT_KEY, expert_ranks

MLP_TYPES = ("standard", "residual")

class ConfigError(ValueError):
    """A GPTConfig value that cannot work; ``field`` names the GPTConfig field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class GPTConfig:
    """Shape of the model and the MoE arguments of its MoE blocks (DeepSpeed's `MoE` names in brackets)."""

    vocab_size: int
    seq_length: int
    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int = 0  # 0: 4 x hidden_size
    num_experts: Sequence[int] = field(default=(1,))  # one int for every MoE block, or one per MoE block
    expert_interval: int = 2
    mlp_type: str = "standard"  # residual = PR-MoE (use_residual)
    topk: int = 1  # (k)
    ep_size: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    dropless: bool = False  # keep every route, no capacity (deepnvme's, not DeepSpeed's)
    use_rts: bool = True
    top2_2nd_expert_sampling: bool = True
    noisy_gate_policy: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_experts, int):
            self.num_experts = (self.num_experts,)
        self.num_experts = tuple(self.num_experts)
        if self.ffn_hidden_size == 0:
            self.ffn_hidden_size = 4 * self.hidden_size
        self.validate()

    def validate(self) -> None:
        """Raise on the first bad field: TypeError for a wrong type, ConfigError (a ValueError carrying the
        field's name) for a wrong value; nothing is asserted."""
        for name in ("vocab_size", "seq_length", "num_layers", "hidden_size", "num_attention_heads",
                     "ffn_hidden_size", "expert_interval", "topk", "ep_size"):
            self._int(name, getattr(self, name), 1)
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("hidden_size", f"hidden_size ({self.hidden_size}) must be a multiple of "
                              f"num_attention_heads ({self.num_attention_heads})")
        if self.mlp_type not in MLP_TYPES:
            raise ConfigError("mlp_type", f"mlp_type must be one of {MLP_TYPES}, got {self.mlp_type!r}")
        if not self.num_experts:
            raise ConfigError("num_experts", "num_experts must hold at least one value")
        for e in self.num_experts:
            self._int("num_experts", e, 1)
        moe_blocks = self.num_layers // self.expert_interval
        if len(self.num_experts) not in (1, moe_blocks):
            raise ConfigError(
                "num_experts",
                f"num_experts needs 1 value or one per MoE block ({moe_blocks} for num_layers="
                f"{self.num_layers}, expert_interval={self.expert_interval}), "
                f"got {len(self.num_experts)}: {list(self.num_experts)}",
            )
        routed = [e for e in self.experts_per_layer() if e > 1]
        if self.ep_size > 1 and not routed:
            raise ConfigError("ep_size", f"ep_size={self.ep_size} needs MoE blocks, but every block is dense "
                              f"(num_experts={list(self.num_experts)})")
        for e in routed:
            if e % self.ep_size:
                raise ConfigError("ep_size", f"ep_size ({self.ep_size}) must divide num_experts of every MoE "
                                  f"block, got {e}")
            if self.topk > e:
                raise ConfigError("topk", f"topk ({self.topk}) exceeds the experts of an MoE block ({e})")
        for name in ("capacity_factor", "eval_capacity_factor"):
            try:
                check_positive_number(name, getattr(self, name))
            except ValueError as exc:
                raise ConfigError(name, str(exc)) from None
        self._int("min_capacity", self.min_capacity, 0)
        if not isinstance(self.dropless, bool):
            raise TypeError(f"dropless must be a bool, got {type(self.dropless).__name__}")

    @staticmethod
    def _int(name: str, value: Any, minimum: int) -> None:
        try:
            check_int(name, value, minimum)
        except ValueError as exc:
            raise ConfigError(name, str(exc)) from None

    def experts_per_layer(self) -> list[int]:
        """Experts of each block in order (1 = dense MLP), by Megatron-DeepSpeed's rule."""
        per_layer = []
        for layer in range(1, self.num_layers + 1):
            if layer % self.expert_interval:
                per_layer.append(1)
            else:
                index = 0 if len(self.num_experts) == 1 else (layer - 1) // self.expert_interval
                per_layer.append(self.num_experts[index])
        return per_layer

    def to_dict(self) -> dict[str, Any]:
        """Plain types only, so a checkpoint holding it loads with weights_only=True."""
        d = asdict(self)
        d["num_experts"] = list(self.num_experts)
        return d


class MLP(nn.Module):
    """The feed-forward block; also the expert that MoE copies."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, ffn_hidden_size)
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """GELU MLP over the last dimension (any leading dims, as MoE's experts need)."""
        return self.fc2(F.gelu(self.fc1(x)))

    def grouped_steps(self) -> list[Any]:
        """What forward computes, for deepnvme.moe to run all experts of a layer at once."""
        return [self.fc1, F.gelu, self.fc2]


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask (torch's fused kernel)."""

    def __init__(self, hidden_size: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, M] -> [B, T, M]."""
        b, t, m = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, m // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, m))


class Block(nn.Module):
    """Pre-LayerNorm transformer block whose MLP is dense or an MoE layer."""

    def __init__(self, cfg: GPTConfig, num_experts: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = CausalSelfAttention(cfg.hidden_size, cfg.num_attention_heads)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size)
        expert = MLP(cfg.hidden_size, cfg.ffn_hidden_size)
        self.is_moe = num_experts > 1
        if not self.is_moe:
            self.mlp: nn.Module = expert
            return
        from deepnvme.moe import MoE

        self.mlp = MoE(
            cfg.hidden_size,
            expert,
            num_experts=num_experts,
            ep_size=cfg.ep_size,
            k=cfg.topk,
            capacity_factor=cfg.capacity_factor,
            eval_capacity_factor=cfg.eval_capacity_factor,
            min_capacity=cfg.min_capacity,
            use_residual=cfg.mlp_type == "residual",
            noisy_gate_policy=cfg.noisy_gate_policy,
            drop_tokens=cfg.drop_tokens,
            use_rts=cfg.use_rts,
            dropless=cfg.dropless,
            top2_2nd_expert_sampling=cfg.top2_2nd_expert_sampling,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(new hidden states, l_aux or None, exp_counts or None)."""
        x = x + self.attn(self.ln_1(x))
        h = self.ln_2(x)
        if not self.is_moe:
            return x + self.mlp(h), None, None
        out, l_aux, exp_counts = self.mlp(h)
        return x + out, l_aux, exp_counts


class GPT(nn.Module):
    """Token + position embeddings, blocks, final LayerNorm, output head tied to the token embedding."""

    def __init__(self, cfg: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.seq_length, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg, e) for e in cfg.experts_per_layer())
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.exp_counts: list[torch.Tensor] = []
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Draw every parameter from a generator keyed by (seed, its global name); see the module doc."""
        proj_std = 0.02 / math.sqrt(2 * self.cfg.num_layers)
        for name, p in self.named_parameters():
            key = _global_name(name, self)
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # LayerNorm gains
                p.fill_(1.0)
            else:
                std = proj_std if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)

    def moe_layers(self) -> list[nn.Module]:
        """The MoE modules in named_modules() order, which is the order checkpoints number them."""
        return [b.mlp for b in self.blocks if b.is_moe]

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, T, vocab] and the sum of the MoE layers' aux losses (0 without MoE blocks).

        Each MoE layer's exp_counts are kept in `self.exp_counts` for logging expert load.
        """
        b, t = idx.shape
        if t > self.cfg.seq_length:
            raise ValueError(f"sequence of {t} tokens is longer than seq_length={self.cfg.seq_length}")
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        aux = x.new_zeros((), dtype=torch.float32)
        self.exp_counts = []
        for block in self.blocks:
            x, l_aux, counts = block(x)
            if l_aux is not None:
                aux = aux + l_aux
                self.exp_counts.append(counts)
        return F.linear(self.ln_f(x), self.wte.weight), aux


def _global_name(name: str, model: GPT) -> str:
    """A parameter's name with a rank-local expert index replaced by its global expert id."""
    m = EXPERT_KEY.match(name)
    if m is None:
        return name
    layer = model.get_submodule(m.group("layer"))
    global_id = expert_ranks(layer)[0] * layer.num_local_experts + int(m.group("local"))
    return f"{m.group('layer')}.deepspeed_moe.experts.deepspeed_experts.{global_id}.{m.group('rest')}"


def count_parameters(model: GPT) -> dict[str, int]:
    """Parameters of the whole model (all ranks' experts) and those one token passes through (active)."""
    cfg = model.cfg
    ffn = cfg.hidden_size * cfg.ffn_hidden_size * 2 + cfg.ffn_hidden_size + cfg.hidden_size
    total = active = 0
    for name, p in model.named_parameters():
        if EXPERT_KEY.match(name) is None:
            total += p.numel()
            active += p.numel()
    for e in cfg.experts_per_layer():
        if e > 1:
            total += e * ffn
            active += cfg.topk * ffn
    return {"total": total, "active": active}

"""A synthetic language task where specialised capacity pays: many topics, each with its own word mapping.

Every sequence opens with a topic token t, then alternates a free token x (uniform) and its answer
y = table[t][x] (with probability 1 - noise; otherwise a uniform token). Predicting y needs the topic
(carried by attention from position 0) and a lookup in a table of topics x words facts, so a model learns it
as fast as its feed-forward layers can store the facts. A router that sends each topic to its own experts
gives the MoE more storage for the same compute per token, which is the claim the recipe measures.

The free tokens are unpredictable by design, so every model has the same loss floor (`loss_floor`), and the
figures can be read as the distance to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TopicTask:
    """The task's shape; the tables follow from `seed`, so every rank and every run sees the same facts."""

    num_topics: int = 16
    num_words: int = 64
    seq_length: int = 32
    noise: float = 0.1
    seed: int = 1234

    def __post_init__(self) -> None:
        for name in ("num_topics", "num_words", "seq_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 2:
                raise ValueError(f"{name} must be an int >= 2, got {value!r}")
        if not 0.0 <= self.noise <= 1.0:
            raise ValueError(f"noise must be in [0, 1], got {self.noise!r}")

    @property
    def vocab_size(self) -> int:
        """Topic tokens first (0..num_topics-1), then the words."""
        return self.num_topics + self.num_words

    def table(self) -> torch.Tensor:
        """The facts: table[t, x] is the word (0-based, no topic offset) that answers x in topic t."""
        import torch

        g = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, self.num_words, (self.num_topics, self.num_words), generator=g)

    def batch(self, size: int, generator: torch.Generator, table: torch.Tensor | None = None) -> torch.Tensor:
        """`size` sequences of seq_length + 1 tokens (inputs are [:, :-1], targets [:, 1:])."""
        import torch

        if table is None:
            table = self.table()
        n = self.seq_length + 1
        pairs = (self.seq_length + 1) // 2  # positions 1.. alternate x, y
        topic = torch.randint(0, self.num_topics, (size,), generator=generator)
        x = torch.randint(0, self.num_words, (size, pairs), generator=generator)
        y = table[topic.unsqueeze(1), x]
        noisy = torch.rand(size, pairs, generator=generator) < self.noise
        y = torch.where(noisy, torch.randint(0, self.num_words, (size, pairs), generator=generator), y)
        body = torch.stack((x, y), dim=2).reshape(size, 2 * pairs) + self.num_topics
        return torch.cat((topic.unsqueeze(1), body), dim=1)[:, :n].contiguous()

    def loss_floor(self) -> float:
        """Mean cross-entropy (nats per target token) of the true distribution: no model can go below it."""
        w = self.num_words
        free = math.log(w)
        p_hit = 1.0 - self.noise + self.noise / w
        p_miss = self.noise / w
        answer = -p_hit * math.log(p_hit) - ((w - 1) * p_miss * math.log(p_miss) if p_miss > 0 else 0.0)
        # Targets are positions 1..seq_length: x at odd positions, y at even ones.
        targets = range(1, self.seq_length + 1)
        return sum(free if i % 2 == 1 else answer for i in targets) / self.seq_length

"""How much of a streamed model's budget its experts get, and when the next layers' experts are worth reading
ahead (see streamer.py): a policy of numbers, kept apart from the streaming that follows it."""

from __future__ import annotations

from deepnvme.offload._doors import PAGE

#: The share of a layer's experts its tokens must be expected to use for the next layers' experts to be read
#: ahead, all of them in order: at this share a tenth of what is read ahead goes unused at most, a price
#: worth the drive never waiting for the router; below it, the reads no token needs soon outweigh it.
FULL_USE = 0.9


def expected_share(tokens: int, k: int, num_experts: int) -> float:
    """The share of a layer's `num_experts` experts that `tokens` tokens, each routed to `k` of them, are
    expected to use when routing spreads evenly: an expert is left out by one token with probability
    1 - k/E, by all of them with (1 - k/E)^tokens. For 16 tokens and 2 of 8 experts: 0.99; for one: 0.25."""
    if num_experts <= 0 or tokens <= 0 or k <= 0:
        return 0.0
    return 1.0 - (1.0 - min(k, num_experts) / num_experts) ** tokens


def split_budget(budget: int, dense_units: list[int], expert_largest: int) -> tuple[int, int]:
    """(dense pool bytes, expert cache bytes) of `budget`, given the pool bytes of each dense unit (a block
    without its experts) and of the largest expert.

    Every token runs every dense unit but only k of each layer's E experts, so a byte of dense unit saves
    more reads than a byte of cache: when all dense units fit in half the budget they get it (read once,
    then kept across forwards by stream_weights), else room for two of the largest (one runs while the
    next is read). The experts get the rest, at least their largest; ValueError naming both sizes when
    even that does not fit."""
    budget = budget // PAGE * PAGE
    largest = max(dense_units, default=0)
    if largest + expert_largest > budget:
        raise ValueError(f"budget_bytes={budget} cannot hold the largest unit ({largest} bytes) and "
                         f"the largest expert ({expert_largest} bytes) together: raise budget_bytes to at "
                         f"least {largest + expert_largest}")
    every = sum(dense_units) + PAGE
    if every <= budget // 2 and every + expert_largest <= budget:
        dense = every
    else:
        dense = min(max(2 * largest, PAGE), budget - expert_largest)
    return dense, budget - dense


__all__ = ["FULL_USE", "expected_share", "split_budget"]

"""Child of test_stream_memory: joins a memory cgroup, then streams a model bigger than its limit.

argv: store directory, budget bytes, cgroup directory (whose memory.limit_in_bytes the parent set), and
how the model is made: "meta" (built with init_empty_weights, then stream_weights) or "one_call"
(deepnvme.offload.from_pretrained, config and all read inside the group).
Prints one JSON line: the generated tokens, peak RSS, the group's peak usage and limit.
"""

from __future__ import annotations

import json
import os
import resource
import sys

import torch


def main() -> None:
    store, budget, group, how = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from deepnvme.offload import from_pretrained, stats, stream_weights
    from tests.offload.stream_models import PROMPT

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(store)).eval()
    torch.empty(1 << 20).add_(1)  # the allocator's first arena, before joining
    # From here on every page this process takes is charged to the group (cgroup v1 leaves the charges of
    # pages it already had where they were): the pool, the tensors outside units, activations, page cache.
    with open(os.path.join(group, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    if how == "one_call":
        del model
        model = from_pretrained(store, budget)
    else:
        stream_weights(model, store, budget)
    with torch.inference_mode():
        tokens = model.generate(PROMPT, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    with open(os.path.join(group, "memory.max_usage_in_bytes")) as f:
        group_peak = int(f.read())
    s = stats(model)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"tokens": tokens.tolist(), "peak_rss": peak_rss, "group_peak": group_peak,
                      "streamed_bytes": s["streamed_bytes"], "bytes_read": s["bytes_read"],
                      "resident_bytes": s["resident_bytes"]}))


if __name__ == "__main__":
    main()

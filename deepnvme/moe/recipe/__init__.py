"""The NLG+MoE recipe: a small GPT with DeepSpeed-style MoE blocks trained on a synthetic topic task.

Run it with ``python3 -m deepnvme.moe.recipe --help``. It is an example built on the MoE library
(:mod:`deepnvme.moe`), kept apart from it: the recipe imports the library, never the other way round.

- :mod:`.gpt`        the model (causal transformer, an MoE block every few blocks, PR-MoE) and its config
- :mod:`.synthetic`  the task and its loss floor
- :mod:`.settings`   the values one run takes (TrainSettings)
- :mod:`.loop`       the training loop on one rank: data, DP + EP gradient reduction, eval, MoS, checkpoints
- :mod:`.distill`    the Mixture-of-Students loss
- :mod:`.cli`        flags (Megatron-DeepSpeed's names) to settings, and the processes
- :mod:`.curves`     loss curves and the summary table of runs
"""

"""Run the NLG+MoE recipe's comparison and write its curves (PNG) and table (markdown).

    python3 bench/moe_recipe.py [--iters 600] [--nproc 2] [--out bench/results]

One run after another, the same task, seeds, batch and schedule for every model, each through
`python3 -m deepnvme.moe.recipe` with --nproc processes (gloo):
  dense        every block a dense MLP (the baseline of the same active size as MoE top-1)
  moe-8        MoE blocks every other layer, 8 experts, top-1, expert parallel over the processes
  pr-moe-4-8   PR-MoE: residual MLP type, pyramid 4 then 8 experts (its checkpoint is the MoS teacher)
  student      a shallower PR-MoE (one block fewer), trained alone
  mos-student  the same student distilled from pr-moe-4-8 (Mixture-of-Students), KD stopped at 3/4 of training

`--only LABEL...` reruns some models and reads the others' JSON from --out (a MoS rerun needs --teacher-dir
of an earlier run); `--only` with no label just redraws.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from _harness import ROOT as REPO  # first: puts this checkout on sys.path

from deepnvme.moe.recipe.curves import plot_curves, results_table

# The task and model every run shares: small enough for a few minutes per run on 2 busy cores, with more
# topic facts than the dense baseline's MLPs learn in that time.
COMMON = ("--hidden-size 32 --num-attention-heads 4 --seq-length 32 --num-topics 32 --num-words 64 "
          "--micro-batch-size 32 --moe-train-capacity-factor 1.25 --moe-eval-capacity-factor 2 "
          "--moe-loss-coeff 0.1 --seed 1234").split()


def runs(iters: int, nproc: int, teacher: str) -> list[tuple[str, list[str]]]:
    """(label, flags) of each run, in the order they must run (the teacher before its student)."""
    ep = f"--moe-expert-parallel-size {nproc}".split()
    student = "--num-layers 3 --num-experts 8 --mlp-type residual".split() + ep
    pr_moe = "--num-layers 4 --num-experts 4 8 --mlp-type residual".split() + ep
    return [
        ("dense", "--num-layers 4 --num-experts 1".split()),
        ("moe-8", "--num-layers 4 --num-experts 8".split() + ep),
        ("pr-moe-4-8", pr_moe + ["--save", teacher]),
        ("student", student),
        ("mos-student", student + ["--mos", "--load-teacher", teacher,
                                   "--kd-stop-iter", str(3 * iters // 4)]),
    ]


def _train(label: str, flags: list[str], log: str, args: argparse.Namespace, env: dict[str, str]) -> None:
    cmd = [sys.executable, "-m", "deepnvme.moe.recipe", "--nproc", str(args.nproc), "--train-iters",
           str(args.iters), "--eval-interval", str(max(1, args.iters // 12)), "--log-json", log,
           *COMMON, *flags]
    print(f"== {label}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=True, env=env)


def _student_seeds(args: argparse.Namespace, env: dict[str, str], teacher: str) -> str:
    """The student alone and with MoS at each of --mos-seeds (training seeds; same task and teacher)."""
    finals: dict[str, list[float]] = {"student": [], "mos-student": []}
    for seed in args.mos_seeds:
        for label, flags in runs(args.iters, args.nproc, teacher)[3:]:
            log = os.path.join(args.out, f"moe_recipe_seeds_{label}_{seed}.json")
            if not os.path.exists(log):
                _train(f"{label} seed {seed}", [*flags, "--seed", str(seed)], log, args, env)
            with open(log) as f:
                finals[label].append(json.load(f)["final_val_loss"])
    lines = ["| training seed | " + " | ".join(str(s) for s in args.mos_seeds) + " | mean |",
             "|" + " --- |" * (len(args.mos_seeds) + 2)]
    for label, values in finals.items():
        cells = " | ".join(f"{v:.4f}" for v in values)
        lines.append(f"| {label} final val loss | {cells} | {sum(values) / len(values):.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run every model, then draw and tabulate; each run's JSON is kept beside the figures."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=600)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    p.add_argument("--teacher-dir", default=None, help="where the MoS teacher is saved (default: a temp dir)")
    p.add_argument("--only", nargs="*", default=None, help="labels to (re)run; the rest are read from --out")
    p.add_argument("--mos-seeds", type=int, nargs="*", default=[],
                   help="also train student and MoS student at these seeds (runs found in --out are reused)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    results = {}
    seeds_table = ""
    with tempfile.TemporaryDirectory(prefix="moe_recipe_") as scratch:
        teacher = args.teacher_dir or os.path.join(scratch, "teacher")
        for label, flags in runs(args.iters, args.nproc, teacher):
            log = os.path.join(args.out, f"moe_recipe_{label}.json")
            if args.only is None or label in args.only:
                _train(label, flags, log, args, env)
            with open(log) as f:
                results[label] = json.load(f)
        if args.mos_seeds:
            seeds_table = _student_seeds(args, env, teacher)
    title = f"synthetic topic task, {args.nproc} gloo processes (CPU), {args.iters} iterations"
    png = plot_curves(results, os.path.join(args.out, "moe_recipe.png"), title=title)
    table = results_table(results, baseline="dense")
    floor = next(iter(results.values()))["loss_floor"]
    with open(os.path.join(args.out, "moe_recipe.md"), "w") as f:
        f.write(f"{title}; `python3 bench/moe_recipe.py --iters {args.iters} --nproc {args.nproc}`.\n"
                f"Validation loss in nats per token; the task's floor (true distribution) is {floor:.4f}. "
                "Train time is wall time on a shared machine, not a speed comparison.\n\n" + table)
        if seeds_table:
            f.write("\nStudent alone and distilled (MoS) from the same teacher, other training seeds "
                    f"(`--mos-seeds {' '.join(map(str, args.mos_seeds))}`):\n\n" + seeds_table)
    print(table + seeds_table)
    print(f"curves: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Train the small GPT with MoE layers on the synthetic topic task: the NLG+MoE recipe in one command.

    python3 -m deepnvme.moe.recipe --nproc 2 --num-experts 8 --moe-expert-parallel-size 2 --train-iters 600
    python3 -m deepnvme.moe.recipe --nproc 2 --num-experts 4 8 --mlp-type residual --save ckpt/prmoe  # PR-MoE
    python3 -m deepnvme.moe.recipe --nproc 2 --num-layers 2 --num-experts 8 --mlp-type residual \\
        --mos --load-teacher ckpt/prmoe --kd-temp 1.0                                            # MoS

Flags carry Megatron-DeepSpeed's names. Processes: `--nproc N` spawns N gloo processes on this machine
(data parallel, with expert parallelism inside each group of --moe-expert-parallel-size ranks); under torchrun
the script takes RANK/WORLD_SIZE from the environment instead. `--log-json` writes the loss curve.
This module only turns flags into :class:`~deepnvme.moe.recipe.settings.TrainSettings` and starts the ranks;
the training loop is :mod:`deepnvme.moe.recipe.loop`.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
from dataclasses import asdict
from typing import Any

from deepnvme.moe.grouped import IMPLS
from deepnvme.moe.recipe.gpt import ConfigError, GPTConfig
from deepnvme.moe.recipe.settings import Teacher, TrainSettings
from deepnvme.moe.recipe.synthetic import TopicTask

# GPTConfig field -> the flag that sets it, so a config error (which carries its field) names what the user
# typed.
FLAG_OF_FIELD = {
    "num_experts": "--num-experts",
    "ep_size": "--moe-expert-parallel-size",
    "topk": "--topk",
    "mlp_type": "--mlp-type",
    "capacity_factor": "--moe-train-capacity-factor",
    "eval_capacity_factor": "--moe-eval-capacity-factor",
    "min_capacity": "--moe-min-capacity",
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "ffn_hidden_size": "--ffn-hidden-size",
    "expert_interval": "--expert-interval",
    "seq_length": "--seq-length",
}


class FlagError(ValueError):
    """A flag whose value cannot work with the others; ``flag`` is the flag as the user types it."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text}")
    return value


def _nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _nonnegative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The recipe's flags (Megatron-DeepSpeed names where it has one)."""
    p = argparse.ArgumentParser(prog="python3 -m deepnvme.moe.recipe", description=__doc__.split("\n")[0])
    m = p.add_argument_group("model")
    m.add_argument("--num-layers", type=_positive_int, default=4)
    m.add_argument("--hidden-size", type=_positive_int, default=64)
    m.add_argument("--num-attention-heads", type=_positive_int, default=4)
    m.add_argument("--ffn-hidden-size", type=_positive_int, default=None, help="default: 4 x hidden size")
    m.add_argument("--seq-length", type=_positive_int, default=32)
    e = p.add_argument_group("mixture of experts")
    e.add_argument(
        "--num-experts",
        type=_positive_int,
        nargs="+",
        default=[1],
        help="experts per MoE block: one value for all, or one per MoE block (pyramid); 1 = dense",
    )
    e.add_argument(
        "--expert-interval", type=_positive_int, default=2, help="every n-th block is an MoE block"
    )
    e.add_argument(
        "--mlp-type",
        choices=("standard", "residual"),
        default="standard",
        help="residual = PR-MoE (a dense MLP beside the routed experts)",
    )
    e.add_argument("--topk", type=_positive_int, default=1)
    e.add_argument("--moe-expert-parallel-size", "--ep-size", dest="ep_size", type=_positive_int, default=1)
    e.add_argument("--moe-train-capacity-factor", type=_positive_float, default=1.0)
    e.add_argument("--moe-eval-capacity-factor", type=_positive_float, default=1.0)
    e.add_argument("--moe-min-capacity", type=_nonnegative_int, default=4)
    e.add_argument("--disable-moe-token-dropping", action="store_true")
    e.add_argument("--moe-dropless", action="store_true",
                   help="keep every route: no capacity, no padding, exactly the routed rows per expert")
    e.add_argument("--moe-experts", choices=("auto", *IMPLS), default="auto",
                   help="how a layer's experts are multiplied (DEEPNVME_MOE_EXPERTS; auto: the library's "
                   "choice for the device and dtype, see deepnvme.moe.grouped)")
    e.add_argument("--disable-moe-top2-2nd-expert-sampling", action="store_true")
    e.add_argument(
        "--moe-loss-coeff",
        type=_nonnegative_float,
        default=0.1,
        help="weight of the summed aux losses (Megatron-DeepSpeed's default; its example scripts use 0.01)",
    )
    e.add_argument(
        "--create-moe-param-group",
        action="store_true",
        help="accepted for Megatron-DeepSpeed scripts; expert params always get their own groups here",
    )
    k = p.add_argument_group("mixture of students (distillation)")
    k.add_argument(
        "--mos", action="store_true", help="train this (smaller) model as a student of --load-teacher"
    )
    k.add_argument("--kd", action="store_true", help="same as --mos")
    k.add_argument("--load-teacher", default=None, help="checkpoint folder of the trained teacher")
    k.add_argument("--num-layers-teacher", type=_positive_int, default=None)
    k.add_argument("--hidden-size-teacher", type=_positive_int, default=None)
    k.add_argument("--num-attention-heads-teacher", type=_positive_int, default=None)
    k.add_argument("--num-experts-teacher", type=_positive_int, nargs="+", default=None)
    k.add_argument("--kd-temp", type=_positive_float, default=1.0)
    k.add_argument("--kd-alpha-ce", type=_nonnegative_float, default=1.0, help="weight of the LM loss")
    k.add_argument(
        "--kd-beta-ce", type=_nonnegative_float, default=1.0, help="weight of the distillation loss"
    )
    k.add_argument(
        "--kd-stop-iter",
        type=_nonnegative_int,
        default=None,
        help="staged KD: LM loss only from this iteration on",
    )
    t = p.add_argument_group("training")
    t.add_argument("--train-iters", type=_nonnegative_int, default=600)
    t.add_argument("--micro-batch-size", type=_positive_int, default=32, help="sequences per rank and step")
    t.add_argument("--lr", type=_positive_float, default=3e-3)
    t.add_argument("--min-lr", type=_nonnegative_float, default=3e-4)
    t.add_argument("--lr-warmup-iters", type=_nonnegative_int, default=50)
    t.add_argument("--weight-decay", type=_nonnegative_float, default=0.0)
    t.add_argument("--seed", type=int, default=1234, help="weights, training batches and routing noise")
    t.add_argument("--eval-interval", type=_positive_int, default=50)
    t.add_argument("--eval-iters", type=_positive_int, default=8, help="validation batches per rank")
    t.add_argument("--save", default=None, help="checkpoint folder to write at the end")
    t.add_argument("--load", default=None, help="checkpoint folder to start from (weights, any ep size)")
    d = p.add_argument_group("task and processes")
    d.add_argument("--num-topics", type=_positive_int, default=16)
    d.add_argument("--num-words", type=_positive_int, default=64)
    d.add_argument("--task-noise", type=_nonnegative_float, default=0.1)
    d.add_argument("--task-seed", type=int, default=1234, help="the task's facts and the validation set")
    d.add_argument(
        "--nproc", type=_positive_int, default=1, help="processes to spawn (ignored under torchrun)"
    )
    d.add_argument("--threads", type=_positive_int, default=None, help="torch threads per process")
    d.add_argument("--log-json", default=None, help="write the loss curve and figures here as JSON (rank 0)")
    return p


def _world_size(args: argparse.Namespace) -> int:
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else args.nproc


def model_config(args: argparse.Namespace, vocab_size: int) -> GPTConfig:
    """The GPTConfig the flags describe; raises ConfigError carrying the config field."""
    return GPTConfig(
        vocab_size=vocab_size,
        seq_length=args.seq_length,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size or 0,
        num_experts=tuple(args.num_experts),
        expert_interval=args.expert_interval,
        mlp_type=args.mlp_type,
        topk=args.topk,
        ep_size=args.ep_size,
        capacity_factor=args.moe_train_capacity_factor,
        eval_capacity_factor=args.moe_eval_capacity_factor,
        min_capacity=args.moe_min_capacity,
        drop_tokens=not args.disable_moe_token_dropping,
        dropless=args.moe_dropless,
        top2_2nd_expert_sampling=not args.disable_moe_top2_2nd_expert_sampling,
    )


def task_from_args(args: argparse.Namespace) -> TopicTask:
    """The synthetic task the flags describe."""
    return TopicTask(
        num_topics=args.num_topics,
        num_words=args.num_words,
        seq_length=args.seq_length,
        noise=args.task_noise,
        seed=args.task_seed,
    )


# --<flag>-teacher -> the field of the teacher's saved GPTConfig it must match
TEACHER_FLAGS = {"num_layers_teacher": "num_layers", "hidden_size_teacher": "hidden_size",
                 "num_attention_heads_teacher": "num_attention_heads", "num_experts_teacher": "num_experts"}


def teacher_config(args: argparse.Namespace) -> dict[str, Any]:
    """The teacher's GPTConfig (as a dict) from its checkpoint, at this run's ep size.

    Raises FlagError naming the flag at fault; the --*-teacher flags must match the checkpoint.
    """
    from deepnvme.moe.checkpoint import read_client_state

    try:
        saved = read_client_state(args.load_teacher)
    except (OSError, ValueError) as exc:
        raise FlagError("--load-teacher",
                        f"cannot read a checkpoint in {args.load_teacher!r}: {exc}") from exc
    if "gpt_config" not in saved:
        raise FlagError("--load-teacher", f"the checkpoint in {args.load_teacher!r} holds no gpt_config")
    ours = asdict(task_from_args(args))
    if saved.get("task") != ours:
        raise FlagError("--load-teacher",
                        f"the teacher learnt another task ({saved.get('task')}), not {ours}")
    cfg = dict(saved["gpt_config"])
    for flag, field in TEACHER_FLAGS.items():
        wanted = getattr(args, flag)
        if wanted is not None and (wanted if isinstance(wanted, list) else [wanted]) != (
                cfg[field] if isinstance(cfg[field], list) else [cfg[field]]):
            raise FlagError(f"--{flag.replace('_', '-')}", f"{wanted} does not match the teacher "
                            f"checkpoint's {field}={cfg[field]}")
    cfg["ep_size"] = args.ep_size
    try:
        GPTConfig(**cfg)
    except ValueError as exc:
        raise FlagError("--load-teacher", f"the teacher cannot run at this ep size: {exc}") from exc
    return cfg


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and cross-check the flags; a bad value exits with argparse's error naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.task_noise > 1:
        parser.error(f"argument --task-noise: must be in [0, 1], got {args.task_noise}")
    try:
        model_config(args, vocab_size=args.num_topics + args.num_words)
    except ConfigError as exc:
        flag = FLAG_OF_FIELD.get(exc.field)
        parser.error(f"argument {flag}: {exc}" if flag else str(exc))
    world = _world_size(args)
    if world % args.ep_size:
        parser.error(
            f"argument --moe-expert-parallel-size: {args.ep_size} must divide the number of "
            f"processes ({world})"
        )
    args.mos = args.mos or args.kd
    if args.mos and not args.load_teacher:
        parser.error("argument --load-teacher: required with --mos/--kd")
    if args.mos:
        try:
            args.teacher_config = teacher_config(args)
        except FlagError as exc:
            parser.error(f"argument {exc.flag}: {exc}")
    if args.load:
        from deepnvme.moe.checkpoint import latest_tag

        try:
            latest_tag(args.load)
        except OSError as exc:
            parser.error(f"argument --load: {exc}")
    if args.min_lr > args.lr:
        parser.error(f"argument --min-lr: {args.min_lr} is above --lr {args.lr}")
    return args


def settings_from(args: argparse.Namespace) -> TrainSettings:
    """The values the training loop takes, from flags parse_args has checked."""
    task = task_from_args(args)
    teacher = None
    if args.mos:
        teacher = Teacher(path=args.load_teacher, config=args.teacher_config, temperature=args.kd_temp,
                          alpha_ce=args.kd_alpha_ce, beta_ce=args.kd_beta_ce, stop_iter=args.kd_stop_iter)
    return TrainSettings(
        model=model_config(args, task.vocab_size), task=task, train_iters=args.train_iters,
        micro_batch_size=args.micro_batch_size, lr=args.lr, min_lr=args.min_lr,
        lr_warmup_iters=args.lr_warmup_iters, weight_decay=args.weight_decay,
        moe_loss_coeff=args.moe_loss_coeff, seed=args.seed, eval_interval=args.eval_interval,
        eval_iters=args.eval_iters, save=args.save, load=args.load, teacher=teacher, threads=args.threads,
        log_json=args.log_json)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    """Parse, then run here (one process or under torchrun) or spawn --nproc gloo processes."""
    args = parse_args(argv)
    settings = settings_from(args)
    from deepnvme.moe.recipe.loop import run_worker

    if args.moe_experts != "auto":  # read by deepnvme.moe.grouped.choose here and in spawned ranks
        os.environ["DEEPNVME_MOE_EXPERTS"] = args.moe_experts

    if "WORLD_SIZE" in os.environ:
        run_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), settings, None)
    elif args.nproc == 1:
        run_worker(0, 1, settings, f"tcp://127.0.0.1:{free_port()}")
    else:
        import torch.multiprocessing as mp

        mp.spawn(run_worker, args=(args.nproc, settings, f"tcp://127.0.0.1:{free_port()}"), nprocs=args.nproc)
    return 0


if __name__ == "__main__":
    sys.exit(main())

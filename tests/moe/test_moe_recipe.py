"""The NLG+MoE recipe: flags, pyramid, checkpoints across ep sizes (real gloo), PR-MoE, MoS, plots."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp

from deepnvme.moe import checkpoint as ckpt
from deepnvme.moe.recipe.cli import main, model_config, parse_args, settings_from
from deepnvme.moe.recipe.distill import mos_loss
from deepnvme.moe.recipe.gpt import GPT, ConfigError, GPTConfig
from deepnvme.moe.recipe.synthetic import TopicTask

# A model small enough that a step takes milliseconds; eval capacity high enough that nothing is dropped at
# eval, so outputs do not depend on how tokens are split over ranks.
TINY = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 16 --num-topics 4 "
        "--num-words 12 --micro-batch-size 4 --eval-iters 1 --eval-interval 2 --moe-eval-capacity-factor 16 "
        "--lr-warmup-iters 1 --threads 1").split()


def _error_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_num_experts_int_or_pyramid_list() -> None:
    args = parse_args("--num-layers 4 --num-experts 4 8 --mlp-type residual".split())
    assert args.num_experts == [4, 8] and args.mlp_type == "residual"
    cfg = GPTConfig(vocab_size=10, seq_length=8, num_layers=4, num_experts=[4, 8])
    assert cfg.experts_per_layer() == [1, 4, 1, 8]
    cfg = GPTConfig(vocab_size=10, seq_length=8, num_layers=6, num_experts=8)
    assert cfg.experts_per_layer() == [1, 8] * 3
    cfg = GPTConfig(vocab_size=10, seq_length=8, num_layers=6, num_experts=[2, 4, 8], expert_interval=2)
    assert cfg.experts_per_layer() == [1, 2, 1, 4, 1, 8]
    args = parse_args(("--moe-train-capacity-factor 1.25 --moe-eval-capacity-factor 2 --moe-min-capacity 0 "
                       "--disable-moe-token-dropping --topk 2 --num-experts 4 --ep-size 2 --nproc 2 "
                       "--moe-loss-coeff 0.01").split())
    assert args.disable_moe_token_dropping and (args.topk, args.ep_size, args.moe_loss_coeff) == (2, 2, 0.01)
    cfg = model_config(args, vocab_size=10)
    assert (cfg.capacity_factor, cfg.eval_capacity_factor, cfg.min_capacity) == (1.25, 2, 0)
    assert not cfg.drop_tokens
    settings = settings_from(args)
    assert settings.model == model_config(args, settings.task.vocab_size) and settings.moe_loss_coeff == 0.01
    assert settings.teacher is None


@pytest.mark.parametrize("argv, flag", [
    ("--num-layers 6 --num-experts 4 8", "--num-experts"),  # 3 MoE blocks, 2 values
    ("--num-experts 0", "--num-experts"),
    ("--num-experts four", "--num-experts"),
    ("--num-experts 3 --ep-size 2 --nproc 2", "--moe-expert-parallel-size"),
    ("--num-experts 4 --ep-size 2 --nproc 3", "--moe-expert-parallel-size"),
    ("--num-experts 4 --topk 5", "--topk"),
    ("--mlp-type pyramid", "--mlp-type"),
    ("--moe-train-capacity-factor -1", "--moe-train-capacity-factor"),
    ("--moe-eval-capacity-factor 0", "--moe-eval-capacity-factor"),
    ("--moe-min-capacity -2", "--moe-min-capacity"),
    ("--moe-loss-coeff nan", "--moe-loss-coeff"),
    ("--hidden-size 30 --num-attention-heads 4", "--hidden-size"),
    ("--mos", "--load-teacher"),
    ("--kd-temp 0", "--kd-temp"),
])
def test_bad_flags_name_the_flag(argv: str, flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert flag in _error_of(argv.split(), capsys)


def test_config_errors_carry_their_field() -> None:
    """A wrong value is a ConfigError (a ValueError) whose field the CLI maps to its flag; a wrong type is a
    TypeError, as everywhere in deepnvme."""
    for kw, field in (({"num_layers": 4, "num_experts": [4, 8, 16]}, "num_experts"),
                      ({"num_experts": [1], "ep_size": 2}, "ep_size"),
                      ({"mlp_type": "dense"}, "mlp_type"),
                      ({"hidden_size": 30}, "hidden_size"),
                      ({"capacity_factor": 0.0}, "capacity_factor"),
                      ({"min_capacity": -1}, "min_capacity")):
        with pytest.raises(ConfigError, match=field) as caught:
            GPTConfig(vocab_size=10, seq_length=8, **kw)
        assert caught.value.field == field and isinstance(caught.value, ValueError)
    with pytest.raises(TypeError, match="topk"):
        GPTConfig(vocab_size=10, seq_length=8, topk=1.5)
    with pytest.raises(ValueError, match="sequence"):
        GPT(GPTConfig(vocab_size=10, seq_length=4, hidden_size=8, num_attention_heads=2))(
            torch.zeros(1, 5, dtype=torch.long)
        )


def test_task_floor_is_the_true_distributions_loss() -> None:
    task = TopicTask(num_topics=3, num_words=8, seq_length=9, noise=0.25, seed=5)
    g = torch.Generator().manual_seed(0)
    batch = task.batch(4000, g)
    assert torch.equal(batch, task.batch(4000, torch.Generator().manual_seed(0)))
    table = task.table()
    # Cross-entropy of the exact conditional distribution on the sampled data approaches the floor.
    topic = batch[:, 0]
    total = 0.0
    for pos in range(1, task.seq_length + 1):
        tok = batch[:, pos] - task.num_topics
        if pos % 2 == 1:
            p = torch.full(tok.shape, 1.0 / task.num_words)
        else:
            hit = tok == table[topic, batch[:, pos - 1] - task.num_topics]
            p = torch.where(
                hit, 1 - task.noise + task.noise / task.num_words, torch.tensor(task.noise / task.num_words)
            )
        total += float(-p.log().mean())
    assert abs(total / task.seq_length - task.loss_floor()) < 0.02


def test_mos_loss() -> None:
    s = torch.randn(2, 3, 7)
    assert float(mos_loss(s, s.clone(), 2.0)) == pytest.approx(0.0, abs=1e-6)
    assert float(mos_loss(s, torch.randn(2, 3, 7), 1.0)) > 0
    with pytest.raises(ValueError, match="temperature"):
        mos_loss(s, s, 0.0)
    with pytest.raises(ValueError, match="shape"):
        mos_loss(s, s[:, :2], 1.0)


def _logits_at_ep2(rank: int, world: int, save: str, batch_path: str, out_dir: str, port: int) -> None:
    """Child: train a few steps at ep 2 and save; rebuild at ep 2, load, keep the logits of its half batch."""
    from deepnvme.moe.groups import reset_groups
    from deepnvme.moe.recipe.loop import build_model, train

    args = parse_args(TINY + "--nproc 2 --num-experts 4 --ep-size 2 --train-iters 3 --save".split() + [save])
    settings = settings_from(args)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world)
    try:
        train(rank, world, settings)
        saved = ckpt.read_client_state(save)
        model = build_model(GPTConfig(**saved["gpt_config"]), seed=99)  # other weights until loaded
        ckpt.load_moe_checkpoint(model, save)
        model.eval()
        batch = torch.load(batch_path)
        with torch.no_grad():
            logits, _ = model(batch.chunk(world)[rank])
        torch.save(logits, os.path.join(out_dir, f"logits{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()
        reset_groups()


@pytest.mark.usefixtures("routing_op_built")
def test_checkpoint_saved_at_ep2_loads_at_ep1_with_identical_outputs(tmp_path: Path) -> None:
    from deepnvme.moe.recipe.cli import free_port

    save = str(tmp_path / "ckpt")
    task = TopicTask(num_topics=4, num_words=12, seq_length=16)
    batch = task.batch(8, torch.Generator().manual_seed(3))[:, :-1]
    torch.save(batch, tmp_path / "batch.pt")
    port = free_port()
    mp.spawn(_logits_at_ep2, args=(2, save, str(tmp_path / "batch.pt"), str(tmp_path), port), nprocs=2)

    tag = ckpt.latest_tag(save)
    names = sorted(os.listdir(os.path.join(save, tag)))
    assert names == sorted([ckpt.MAIN_FILE] + [ckpt.expert_file(0, e) for e in range(4)])
    # Each expert file holds one expert under its global id; the main file holds no expert.
    expert3 = torch.load(os.path.join(save, tag, ckpt.expert_file(0, 3)), weights_only=True)
    assert all(".deepspeed_experts.3." in k for k in expert3) and expert3
    main_file = torch.load(os.path.join(save, tag, ckpt.MAIN_FILE), weights_only=True)
    assert main_file["num_experts"] == [4] and not any("deepspeed_experts" in k for k in main_file["module"])

    cfg = GPTConfig(**{**ckpt.read_client_state(save)["gpt_config"], "ep_size": 1})
    model = GPT(cfg, seed=7)
    ckpt.load_moe_checkpoint(model, save)
    model.eval()
    with torch.no_grad():
        for rank, half in enumerate(batch.chunk(2)):
            ours, _ = model(half)
            theirs = torch.load(tmp_path / f"logits{rank}.pt")
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_checkpoint_errors_name_the_file(tmp_path: Path) -> None:
    cfg = GPTConfig(
        vocab_size=12, seq_length=8, num_layers=2, hidden_size=8, num_attention_heads=2, num_experts=2
    )
    model = GPT(cfg)
    ckpt.save_moe_checkpoint(model, str(tmp_path), "t", {"note": "x"})
    assert ckpt.read_client_state(str(tmp_path)) == {"note": "x", "num_experts": [2]}
    other = GPT(GPTConfig(**{**cfg.to_dict(), "num_experts": [4]}))
    with pytest.raises(ValueError, match=ckpt.MAIN_FILE):
        ckpt.load_moe_checkpoint(other, str(tmp_path))
    os.unlink(tmp_path / "t" / ckpt.expert_file(0, 1))
    with pytest.raises(FileNotFoundError) as exc:
        ckpt.load_moe_checkpoint(GPT(cfg), str(tmp_path))
    assert exc.value.filename.endswith(ckpt.expert_file(0, 1))
    with pytest.raises(FileNotFoundError):
        ckpt.load_moe_checkpoint(model, str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="tag"):
        ckpt.save_moe_checkpoint(model, str(tmp_path), "a/b")


def test_prmoe_teacher_then_mos_student(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    teacher = str(tmp_path / "teacher")
    log = {name: str(tmp_path / f"{name}.json") for name in ("teacher", "reload", "student")}
    pr_moe = "--num-layers 4 --num-experts 2 4 --mlp-type residual".split()
    assert main(TINY + pr_moe + ["--train-iters", "2", "--save", teacher, "--log-json", log["teacher"]]) == 0
    # The CLI's --load with no training evaluates the saved weights: the teacher's final loss again.
    assert main(TINY + pr_moe + ["--train-iters", "0", "--load", teacher, "--log-json", log["reload"]]) == 0
    student = ("--num-layers 2 --num-experts 4 --mlp-type residual --mos --num-layers-teacher 4 --kd-temp 2 "
               "--kd-stop-iter 1 --train-iters 2").split()
    assert main(TINY + student + ["--load-teacher", teacher, "--log-json", log["student"]]) == 0
    runs = {}
    for name, path in log.items():
        with open(path) as f:
            runs[name] = json.load(f)
        assert all(math.isfinite(p["val_loss"]) for p in runs[name]["curve"])
    assert [p["iter"] for p in runs["student"]["curve"]] == [0, 2] and runs["student"]["mos"] is True
    assert runs["reload"]["final_val_loss"] == pytest.approx(runs["teacher"]["final_val_loss"], abs=1e-6)
    assert runs["reload"]["curve"][0]["val_loss"] != runs["teacher"]["curve"][0]["val_loss"]
    # Teacher flags are checked against the checkpoint before any process starts.
    argv = TINY + "--num-experts 4 --mos --num-experts-teacher 8 --train-iters 1 --load-teacher".split()
    assert "--num-experts-teacher" in _error_of(argv + [teacher], capsys)
    assert "--load-teacher" in _error_of(argv + [str(tmp_path / "none")], capsys)
    assert "--load" in _error_of(TINY + ["--load", str(tmp_path / "none")], capsys)
    other_task = TINY + "--num-experts 4 --mos --task-seed 5 --load-teacher".split() + [teacher]
    assert "another task" in _error_of(other_task, capsys)


def test_plot_and_table(tmp_path: Path) -> None:
    from deepnvme.moe.recipe.curves import plot_curves, results_table

    pytest.importorskip("matplotlib", reason="matplotlib is the optional 'plot' extra")

    def run(losses: list[float], total: int) -> dict:
        return {
            "curve": [{"iter": 10 * i, "val_loss": v} for i, v in enumerate(losses)],
            "loss_floor": 1.0,
            "final_val_loss": losses[-1],
            "params": {"total": total, "active": 5000},
            "train_s": 3.0,
        }

    runs = {"dense": run([4.0, 3.0, 2.5], 5000), "moe-8": run([4.0, 2.5, 1.5], 40000)}
    path = plot_curves(runs, str(tmp_path / "c.png"), title="t")
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    table = results_table(runs, baseline="dense")
    assert "| moe-8 | 40.0 k | 5.0 k | 2.5000 (iter 10) | 1.5000 | 0.5000 | 0.33× | iter 10 | 3 s |" in table
    assert "| dense | 5.0 k | 5.0 k | 3.0000 (iter 10) | 2.5000 | 1.5000 | 1.00× | iter 20 | 3 s |" in table
    with pytest.raises(ValueError, match="empty"):
        plot_curves({}, str(tmp_path / "e.png"))
    with pytest.raises(ValueError, match="png"):
        plot_curves(runs, str(tmp_path / "c.svg"))
    with pytest.raises(ValueError, match="baseline"):
        results_table(runs, baseline="nope")


def test_grouped_experts_and_dropless_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe's experts declare grouped_steps, so its MoE blocks are computed together; --moe-experts
    loop gives the per-expert loop, and the curves agree to rounding. --moe-dropless trains too."""
    from deepnvme.moe.grouped import GroupedExperts

    cfg = model_config(parse_args(TINY + ["--num-experts", "4"]), vocab_size=12)
    block = GPT(cfg).blocks[1]
    assert GroupedExperts.of(block.mlp.deepspeed_moe.experts.deepspeed_experts) is not None
    monkeypatch.delenv("DEEPNVME_MOE_EXPERTS", raising=False)
    curves = {}
    runs = {"auto": [], "loop": ["--moe-experts", "loop"], "dropless": ["--moe-dropless"]}
    for name, extra in runs.items():
        log = tmp_path / f"{name}.json"
        argv = TINY + "--num-experts 4 --topk 2 --train-iters 4".split() + extra + ["--log-json", str(log)]
        with mock.patch.dict(os.environ):  # main() sets DEEPNVME_MOE_EXPERTS for its run: undone after
            assert main(argv) == 0
        curves[name] = [p["val_loss"] for p in json.loads(log.read_text())["curve"]]
        assert all(math.isfinite(v) for v in curves[name])
    assert "DEEPNVME_MOE_EXPERTS" not in os.environ
    assert curves["auto"] == pytest.approx(curves["loop"], rel=1e-4)
    assert GPTConfig(vocab_size=12, seq_length=16, dropless=True).dropless
    with pytest.raises(TypeError, match="dropless"):
        GPTConfig(vocab_size=12, seq_length=16, dropless="yes")  # type: ignore[arg-type]

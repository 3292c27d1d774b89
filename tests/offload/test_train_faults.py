"""offload_parameters under faults: a full disk, a swap file deleted or cut short, a byte changed on the
drive, Ctrl-C in a backward: each an error naming the file or the directory, never wrong values; after
Ctrl-C the run goes on as the same run in memory does (issue 36)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from deepnvme.offload import OffloadedOptimizer
from deepnvme.offload.train import offload_parameters
from tests.offload.helpers import in_forked_child, tmpfs
from tests.offload.train_models import build, loss, train, units_of

BUDGET = 4 << 20
OPT_BUDGET = 8 << 20


def _pair(workdir: Path) -> tuple[nn.Module, nn.Module, object, OffloadedOptimizer]:
    ref, m = build("sequential"), build("sequential")
    off = offload_parameters(m, workdir, BUDGET, units=units_of("sequential", m))
    return ref, m, off, OffloadedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), workdir, OPT_BUDGET)


def test_a_full_disk_is_an_error_naming_the_directory(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "size=64k") as mnt:
        m = build("sequential")
        with pytest.raises(OSError, match="free space") as err:
            offload_parameters(m, mnt, BUDGET, units=units_of("sequential", m))
        assert err.value.filename == str(mnt)
        assert type(m[1].weight) is nn.Parameter  # nothing moved
        assert os.listdir(mnt) == []


def test_a_parameter_unfrozen_on_a_full_disk_is_an_error_naming_it(tmp_path: Path) -> None:
    """Room for gradients is taken when offloading; a parameter frozen then and trained later needs more,
    and a full disk then is an OSError naming the directory, in the backward, before any value changes."""
    with tmpfs(tmp_path / "small", "size=1m") as mnt:
        m = build("sequential")
        for p in m[3].parameters():
            p.requires_grad_(False)
        with offload_parameters(m, mnt, BUDGET, units=units_of("sequential", m)) as off:
            loss("sequential", m, 0, 0).backward()
            free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
            (mnt / "filler").write_bytes(b"\0" * free)
            for p in m[3].parameters():
                p.requires_grad_(True)
            off.units[1].params[0].real.requires_grad_(True)
            off.units[1].params[1].real.requires_grad_(True)
            with pytest.raises(OSError, match="no space|free space") as err:
                loss("sequential", m, 1, 0).backward()
            assert str(mnt) in str(err.value.filename)
            os.unlink(mnt / "filler")


@pytest.mark.parametrize("how", ["deleted", "cut"])
def test_a_swap_file_deleted_or_cut_is_an_error_naming_it(how: str, workdir: Path) -> None:
    _, m, off, opt = _pair(workdir)
    with opt:
        train("sequential", m, opt, 2)
        path = off.space.file  # type: ignore[attr-defined]
        off.space.wait_writes()  # type: ignore[attr-defined]  # (a write landing after the cut would undo it)
        if how == "deleted":
            os.unlink(path)
        else:
            os.truncate(path, 4096)
        with pytest.raises(OSError) as err:
            train("sequential", m, opt, 1, start=2)
        assert err.value.filename == path
    if how == "cut":  # the values cannot be put back: close() says so, and still removes what it made
        with pytest.raises(OSError) as err:
            off.close()  # type: ignore[attr-defined]
        assert err.value.filename == path
    off.close()  # type: ignore[attr-defined]
    assert not any(os.scandir(workdir)) or not any(any(os.scandir(d)) for d in os.scandir(workdir))


def test_ctrl_c_in_a_backward_goes_on_as_in_memory(workdir: Path) -> None:
    """KeyboardInterrupt raised in the middle of a block's backward (its MLP's gradients accumulated, its
    attention's not; the blocks before it not read yet); the caller zeroes the gradients and goes on, as
    with a model in memory: the two runs stay equal bit for bit."""
    pytest.importorskip("transformers", reason="the offload extra (transformers) is needed")
    ref, m = build("llama"), build("llama")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    with offload_parameters(m, workdir, BUDGET) as off, \
            OffloadedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), workdir, OPT_BUDGET) as opt:
        for net, o in ((ref, ref_opt), (m, opt)):
            train("llama", net, o, 2)
            fired: list[int] = []

            def interrupt(mod: nn.Module, grads: object, fired: list[int] = fired) -> None:
                if not fired:
                    fired.append(1)
                    raise KeyboardInterrupt

            handle = net.model.layers[1].self_attn.register_full_backward_pre_hook(interrupt)
            with pytest.raises(KeyboardInterrupt):
                loss("llama", net, 2, 0).backward()
            handle.remove()
            if net is m:
                assert any(u.held for u in off.units)  # a block was mid-backward
            o.zero_grad()
        want = train("llama", ref, ref_opt, 3, start=3)
        got = train("llama", m, opt, 3, start=3)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), m.parameters()))


def test_a_forked_child_is_refused_not_hung(workdir: Path) -> None:
    """A child forked from a process that offloaded a model cannot use its swap space (its I/O threads
    stayed in the parent): a forward or a step there raises RuntimeError saying so, never waits."""
    _, m, off, opt = _pair(workdir)
    with off, opt:  # type: ignore[attr-defined]
        train("sequential", m, opt, 1)

        def child() -> None:
            with pytest.raises(RuntimeError, match="before fork"):
                loss("sequential", m, 0, 0)
            with pytest.raises(RuntimeError, match="before fork"):
                opt.step()

        assert in_forked_child(child) == "ok"
        train("sequential", m, opt, 1, start=1)  # the parent goes on


def test_an_evaluation_thread_beside_training_changes_nothing(workdir: Path) -> None:
    """One thread trains while another runs forwards without autograd on the same model the whole time
    (in its forwards, backwards and steps): the training equals the same training in memory, and every
    evaluation ends without an error (a step waits for the evaluation's forward to leave the model)."""
    import threading

    ref, m, off, opt = _pair(workdir)
    errors: list[BaseException] = []
    runs = [0]
    stop = threading.Event()

    def evaluate() -> None:
        x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(7))
        while not stop.is_set():
            try:
                with torch.no_grad():
                    m(x)
                runs[0] += 1
            except BaseException as exc:  # noqa: BLE001 - reported to the test
                errors.append(exc)
                return

    with off, opt:  # type: ignore[attr-defined]
        worker = threading.Thread(target=evaluate)
        worker.start()
        try:
            got = train("sequential", m, opt, 5)
        finally:
            stop.set()
            worker.join(60)
    want = train("sequential", ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), 5)
    assert not errors, errors
    assert runs[0] > 0 and not worker.is_alive()
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), m.parameters()))

"""deepnvme._core: one argument-check rule, the handle settings checked once, the O_DIRECT refusal rule, and
the typed Protocol kept in step with the compiled handle."""

from __future__ import annotations

import errno
import inspect

import pytest

from deepnvme._core import aio_types
from deepnvme._core.checks import check_int, check_positive_number, check_type
from deepnvme._core.direct import o_direct_refused
from deepnvme._core.handles import LIMITS, RECOMMENDED, check_settings, new_handle


@pytest.mark.parametrize("value", ["3", 2.5, True, None])
def test_check_int_wrong_type_is_a_type_error(value: object) -> None:
    with pytest.raises(TypeError, match="count must be an int"):
        check_int("count", value)


@pytest.mark.parametrize("value, low, high", [(0, 1, None), (-1, 0, None), (9, 1, 8)])
def test_check_int_out_of_range_is_a_value_error(value: int, low: int, high: int | None) -> None:
    with pytest.raises(ValueError, match="count must be"):
        check_int("count", value, low, high)
    assert check_int("count", low, low, high) == low


def test_other_checks_follow_the_same_rule() -> None:
    with pytest.raises(TypeError, match="factor"):
        check_positive_number("factor", "1")
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="factor"):
            check_positive_number("factor", bad)
    assert check_positive_number("factor", 2) == 2.0
    with pytest.raises(TypeError, match="path must be a str or bytes"):
        check_type("path", 3, (str, bytes))


@pytest.mark.parametrize("settings, error, name", [
    ({"queue_depth": 100000}, ValueError, "queue_depth"),
    ({"queue_depth": 0}, ValueError, "queue_depth"),
    ({"block_size": (1 << 62) + 1}, ValueError, "block_size"),
    ({"block_size": -1}, ValueError, "block_size"),
    ({"intra_op_parallelism": 1.5}, TypeError, "intra_op_parallelism"),
    ({"overlap_events": 1}, TypeError, "overlap_events"),
    ({"engine": 3}, TypeError, "engine"),
    ({"queue_depht": 8}, ValueError, "queue_depht"),
])
def test_bad_settings_fail_before_any_handle(settings: dict, error: type[Exception], name: str) -> None:
    with pytest.raises(error, match=name):
        check_settings(settings)
    with pytest.raises(error, match=name):
        new_handle(**settings)


def test_settings_fill_in_the_recommended_ones() -> None:
    assert check_settings({}) == RECOMMENDED
    assert check_settings({"queue_depth": None, "block_size": 4096}) == {**RECOMMENDED, "block_size": 4096}
    deepest = LIMITS["queue_depth"][0]
    assert check_settings({"queue_depth": deepest})["queue_depth"] == deepest


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_python_and_cpp_check_one_limit_per_setting(aio_module, name: str) -> None:
    """The compiled aio_handle (no Python check in front of it) refuses exactly what check_settings
    refuses: one past the limit and 0, with a ValueError naming the setting and its range."""
    limit = LIMITS[name][0]
    for bad in (limit + 1, 0):
        with pytest.raises(ValueError, match=rf"{name} must be in 1\.\.{limit}, got {bad}"):
            aio_module.aio_handle(**{name: bad})
        with pytest.raises(ValueError, match=name):
            check_settings({name: bad})
    if name != "intra_op_parallelism":  # 1024 threads and engines: the bound is the check, not the work
        handle = aio_module.aio_handle(**{name: limit, "engine": "posix"})
        assert getattr(handle, f"get_{name}")() == limit


def test_aio_handle_keeps_deepspeeds_defaults(aio_module) -> None:
    h = aio_module.aio_handle()
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
            h.get_intra_op_parallelism(), h.get_engine() in ("io_uring", "libaio", "posix")) == \
        (1 << 20, 128, False, False, 1, True)


def test_memlock_limit_is_one_rule() -> None:
    import resource

    from deepnvme._core.memory import memlock_limit
    from deepnvme.offload.swap import preflight

    assert memlock_limit(8 << 20, privileged=False) == 8 << 20
    assert memlock_limit(8 << 20, privileged=True) is None
    assert memlock_limit(resource.RLIM_INFINITY, privileged=False) is None
    preflight.check_memlock(16 << 20, 0, limit=resource.RLIM_INFINITY, privileged=False)  # unbounded


def test_new_handle_has_the_settings(aio_module) -> None:
    h = new_handle(queue_depth=4)
    got = {"block_size": h.get_block_size(), "queue_depth": h.get_queue_depth(),
           "single_submit": h.get_single_submit(), "overlap_events": h.get_overlap_events(),
           "intra_op_parallelism": h.get_intra_op_parallelism()}
    assert got == {**RECOMMENDED, "queue_depth": 4}


def test_o_direct_refusal_is_one_rule() -> None:
    for code in (errno.EINVAL, errno.EOPNOTSUPP):
        assert o_direct_refused(OSError(code, "refused"))
    for code in (errno.ENOENT, errno.EACCES, errno.EIO):
        assert not o_direct_refused(OSError(code, "about the file"))


def _methods(proto: type) -> set[str]:
    return {n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")}


def test_protocols_match_the_compiled_op(aio_module) -> None:
    """Every method the Protocols name exists on the op, and the handle's public methods are all named."""
    handle = aio_module.aio_handle()
    assert _methods(aio_types.AioModule) <= set(dir(aio_module))
    assert _methods(aio_types.AioHandle) == {n for n in dir(handle) if not n.startswith("_")}

"""shm.arrays: the check of a request's arrays against a plan, and their writes into their
rings, in one C call each (and the Python equivalents used without the C core)."""

from __future__ import annotations

import numpy as np
import pytest

from shm import Ring, RingTimeoutError, arrays

PLAIN = [pytest.param(arrays.plain_arrays, id="c" if arrays.IN_C else "python"),
         pytest.param(arrays._plain_arrays, id="python")]


def _plan(**shapes: tuple[int, ...]) -> tuple:
    return tuple((name, np.ndarray, b"f", shape) for name, shape in shapes.items())


@pytest.mark.parametrize("plain", PLAIN)
def test_plain_arrays_accepts_exactly_the_planned_arrays(plain) -> None:
    plan = _plan(A=(1, 4), B=(2, 3))
    a = np.ones((1, 4), np.float32)
    b = np.ones((2, 3), np.float32)
    assert plain({"A": a, "B": b}, plan)
    assert plain({"B": b, "A": a}, plan)                              # any order
    assert plain({"A": a, "B": np.ones((2, 6), np.float32)[:, ::2]}, plan)  # not contiguous
    assert not plain({"A": a}, plan)                                  # one missing
    assert not plain({"A": a, "B": b, "C": b}, plan)                  # one more
    assert not plain({"A": a, "C": b}, plan)                          # another name
    assert not plain({"A": a, "B": b.astype(np.float64)}, plan)       # another dtype
    assert not plain({"A": a, "B": b.astype(np.int32)}, plan)         # same size, other kind
    assert not plain({"A": a, "B": b.astype(">f4")}, plan)            # other byte order
    assert not plain({"A": a, "B": b.reshape(3, 2)}, plan)            # another shape
    assert not plain({"A": a, "B": b.reshape(-1)}, plan)              # flat
    assert not plain({"A": a, "B": b.view(np.ma.MaskedArray)}, plan)  # a subclass
    assert not plain({"A": a, "B": b.tolist()}, plan)                 # not an array
    assert not plain({"A": a, "B": memoryview(b)}, plan)              # a buffer, not an array
    assert not plain([("A", a), ("B", b)], plan)                      # not a dict
    assert plain({}, ())


def test_plain_arrays_refuses_a_malformed_plan() -> None:
    if not arrays.IN_C:
        pytest.skip("the C core is not built")
    with pytest.raises(TypeError, match=r"a plan entry is \(key, type, format: bytes, shape"):
        arrays.plain_arrays({"A": np.ones(1)}, (("A", np.ndarray, "d", (1,)),))
    with pytest.raises(TypeError, match=r"plain_arrays\(arrays, plan: tuple\)"):
        arrays.plain_arrays({}, [])


@pytest.fixture
def rings():
    made = [Ring.create(64, 2), Ring.create(64, 2)]
    for r in made:   # a first write through Ring takes the producer role (the C API's rule)
        r.write(b"x", 0, 0.0)
        assert r.read(0.0) == (b"x", 0)
    yield made
    for r in made:   # (with the ones a test made instead)
        r.close()
        r.unlink()


def test_write_arrays_writes_each_array_with_the_tag(rings) -> None:
    if not arrays.IN_C:
        pytest.skip("the C core is not built")
    a = np.arange(4, dtype=np.float32)
    b = np.arange(6, dtype=np.int16).reshape(2, 3)
    plan = (("B", rings[1].c_handle()), ("A", rings[0].c_handle()))
    assert arrays.write_arrays({"A": a, "B": b}, plan, 7 << 8) == 2
    assert rings[0].read(0.0) == (a.tobytes(), 7 << 8)
    assert rings[1].read(0.0) == (b.tobytes(), 7 << 8)


@pytest.mark.parametrize("case", ["missing", "not contiguous", "full", "closed", "no role"])
def test_write_arrays_stops_at_the_first_it_cannot_write_and_leaves_it(rings, case) -> None:
    if not arrays.IN_C:
        pytest.skip("the C core is not built")
    a = np.ones(4, np.float32)
    second = {"missing": None, "not contiguous": np.ones(8, np.float32)[::2]}.get(case, a)
    given = {"A": a} if second is None else {"A": a, "B": second}
    if case == "full":
        rings[1].write(b"1", 1, 0.0)
        rings[1].write(b"2", 2, 0.0)
    if case == "no role":
        rings[1].close()
        rings[1].unlink()
        rings[1] = Ring.create(64, 2)   # no write through Ring yet: the C core leaves it
    plan = (("A", rings[0].c_handle()), ("B", rings[1].c_handle()))
    if case == "closed":
        rings[1].close()
    assert arrays.write_arrays(given, plan, 5) == 1
    assert rings[0].read(0.0) == (a.tobytes(), 5)
    if case == "full":   # untouched: the two messages, and the Python path's own report
        assert [rings[1].read(0.0)[1] for _ in range(2)] == [1, 2]
    elif case in ("missing", "not contiguous", "no role"):
        assert not rings[1].readable()
        if case == "no role":   # and Ring.write then does it (taking the role)
            rings[1].write(a, 5, 0.0)
            assert rings[1].read(0.0) == (a.tobytes(), 5)
    if case == "full":
        rings[1].write(b"3", 3, 0.0)
        rings[1].write(b"4", 4, 0.0)
        with pytest.raises(RingTimeoutError):
            rings[1].write(a, 5, 0.0)


def test_without_the_c_core_nothing_is_written(rings) -> None:
    """The Python equivalent writes nothing: the caller writes every array itself."""
    a = np.ones(4, np.float32)
    assert arrays._write_arrays({"A": a}, (("A", rings[0].c_handle()),), 1) == 0
    assert not rings[0].readable()

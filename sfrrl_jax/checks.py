"""Checks of configuration values, shared by the config dataclasses of every room.

gin and JSON hand values over as written: `True` where an int belongs (bool is an int subclass,
so `True >= 1` passes), '128' where a number belongs, nan (every comparison with it is False, so
`x < 0` checks wave it through). These helpers check the type first, then finiteness, then the
range, and name the field ("TrainerConfig.max_len") in every message.
"""
from __future__ import annotations

import math
import numbers
from typing import Iterable

def _fmt(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _range_text(lo, hi, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{_fmt(lo)}, {_fmt(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {_fmt(lo)}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {_fmt(hi)}"
    return ""


def _check_range(where: str, value, lo, hi, lo_open: bool, hi_open: bool) -> None:
    below = lo is not None and (value <= lo if lo_open else value < lo)
    above = hi is not None and (value >= hi if hi_open else value > hi)
    if below or above:
        raise ValueError(f"{where} must be {_range_text(lo, hi, lo_open, hi_open)}, got {value!r}")


def _type_error(where: str, kind: str, value, lo, hi, lo_open, hi_open, optional: bool) -> ValueError:
    rng = _range_text(lo, hi, lo_open, hi_open)
    return ValueError(f"{where} must be {kind}{' ' + rng if rng else ''}{' or None' if optional else ''}, "
                      f"got {value!r} ({type(value).__name__})")


def check_int(where: str, value, lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False,
              optional: bool = False) -> None:
    """Raises ValueError naming `where` unless `value` is an int (not a bool) in the range."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _type_error(where, "an int", value, lo, hi, lo_open, hi_open, optional)
    _check_range(where, value, lo, hi, lo_open, hi_open)


def check_number(where: str, value, lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False,
                 optional: bool = False) -> None:
    """Raises ValueError naming `where` unless `value` is a finite real (int or float, not a bool)
    in the range."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _type_error(where, "a number", value, lo, hi, lo_open, hi_open, optional)
    if not math.isfinite(value):
        rng = _range_text(lo, hi, lo_open, hi_open)
        raise ValueError(f"{where} must be {rng + ' and ' if rng else ''}finite, got {value!r}")
    _check_range(where, value, lo, hi, lo_open, hi_open)


def check_bool(where: str, value) -> None:
    """Raises ValueError naming `where` unless `value` is True or False (not 0/1, not 'false')."""
    if not isinstance(value, bool):
        raise ValueError(f"{where} must be True or False, got {value!r} ({type(value).__name__})")


def check_str(where: str, value, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a str{' or None' if optional else ''}, got {value!r} "
                         f"({type(value).__name__})")


def check_int_fields(obj, names: Iterable[str], lo=None, hi=None, optional: bool = False) -> None:
    """`check_int` on each named field of the dataclass `obj` ("Class.field" in messages)."""
    for n in names:
        check_int(f"{type(obj).__name__}.{n}", getattr(obj, n), lo, hi, optional=optional)


def check_number_fields(obj, names: Iterable[str], lo=None, hi=None, *, lo_open: bool = False,
                        hi_open: bool = False, optional: bool = False) -> None:
    for n in names:
        check_number(f"{type(obj).__name__}.{n}", getattr(obj, n), lo, hi, lo_open=lo_open,
                     hi_open=hi_open, optional=optional)


def check_bool_fields(obj, names: Iterable[str]) -> None:
    for n in names:
        check_bool(f"{type(obj).__name__}.{n}", getattr(obj, n))


def check_seed(where: str, value) -> None:
    """Seeds feed numpy's default_rng (rejects negatives) and the engine's uint32 sampling seed."""
    check_int(where, value, 0, 2**32 - 1)

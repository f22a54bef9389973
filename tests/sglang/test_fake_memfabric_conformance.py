"""The ``memfabric_hybrid`` stand-in (``fake_memfabric``) against the installed package.

For every name the stand-in defines (``fake_memfabric.TOP_FUNCTIONS`` / ``BM_FUNCTIONS``
/ ``BM_METHODS`` / ``BM_ATTRIBUTES`` / ``BM_ENUMS``) the real ``memfabric_hybrid`` and its
``bm`` module have it; functions and methods take the same parameters in the same
order with the same defaults (the real ones parsed from their pybind11 ``__doc__``
signature, the stand-in's from ``inspect.signature``); ``BmConfig`` fields have the
same defaults; enums have the same members and values. Negative controls: a drifted
signature, a drifted default and a renamed enum member are each detected.

Importing the real package needs no device (its ``initialize`` calls would fail
without the driver; nothing here calls them).
"""

from __future__ import annotations

import enum
import inspect
import re
from typing import List, Optional, Tuple

import fake_memfabric as fake
import pytest

real = pytest.importorskip("memfabric_hybrid")
real_bm = real.bm

Param = Tuple[str, Optional[str]]  # name, default text (None: no default)


from sglang_ascend_offload.npu_api.packages import _split_top  # noqa: E402


def doc_signatures(obj, name: str) -> List[List[Param]]:
    """Every pybind11 signature of ``name`` in ``obj.__doc__`` (overloads included),
    as ``[(param, default text)]`` without ``self``."""
    doc = obj.__doc__ or ""
    sigs = []
    for m in re.finditer(rf"(?:^|\n)\s*(?:\d+\.\s*)?{re.escape(name)}\((.*)\)\s*->", doc):
        params: List[Param] = []
        for part in _split_top(m.group(1)):
            if part == "/" or part == "*":
                continue
            pname, _, rest = part.partition(":")
            pname = pname.strip()
            default = rest.split("=", 1)[1].strip() if "=" in rest else None
            if pname != "self":
                params.append((pname, default))
        sigs.append(params)
    return sigs


def _default_text(value) -> str:
    if isinstance(value, enum.Enum):
        return f"<{type(value).__name__}.{value.name}: {int(value.value)}>"
    return repr(value)


def fake_signature(fn, method: bool) -> List[Param]:
    params = list(inspect.signature(fn).parameters.values())
    if method:
        params = params[1:]
    return [(p.name, None if p.default is inspect.Parameter.empty else _default_text(p.default)) for p in params]


def compare_callable(real_obj, name: str, fake_fn, method: bool) -> List[str]:
    sigs = doc_signatures(real_obj, name)
    if not sigs:
        return [f"{name}: no pybind11 signature in the real __doc__"]
    mine = fake_signature(fake_fn, method)
    if mine in sigs:
        return []
    return [f"{name}: stand-in {mine} != real {sigs[0] if len(sigs) == 1 else sigs}"]


def compare_enum(real_enum, fake_enum) -> List[str]:
    theirs = {k: int(v) for k, v in real_enum.__members__.items()}
    mine = {m.name: int(m.value) for m in fake_enum}
    return [] if theirs == mine else [f"{fake_enum.__name__}: stand-in {mine} != real {theirs}"]


def all_problems(fake_mod=fake) -> List[str]:
    problems: List[str] = []
    for name in fake_mod.TOP_FUNCTIONS:
        if not hasattr(real, name):
            problems.append(f"memfabric_hybrid.{name} does not exist")
            continue
        problems += compare_callable(getattr(real, name), name, getattr(fake_mod.module(), name), method=False)
    for name in fake_mod.BM_FUNCTIONS:
        if not hasattr(real_bm, name):
            problems.append(f"memfabric_hybrid.bm.{name} does not exist")
            continue
        problems += compare_callable(getattr(real_bm, name), name, getattr(fake_mod.bm, name), method=False)
    for cls, methods in fake_mod.BM_METHODS.items():
        real_cls = getattr(real_bm, cls, None)
        if real_cls is None:
            problems.append(f"memfabric_hybrid.bm.{cls} does not exist")
            continue
        for m in methods:
            if not hasattr(real_cls, m):
                problems.append(f"memfabric_hybrid.bm.{cls}.{m} does not exist")
                continue
            problems += compare_callable(getattr(real_cls, m), m, getattr(getattr(fake_mod.bm, cls), m), method=True)
    for cls, attrs in fake_mod.BM_ATTRIBUTES.items():
        real_obj, fake_obj = getattr(real_bm, cls)(), getattr(fake_mod.bm, cls)()
        for a in attrs:
            if not hasattr(real_obj, a):
                problems.append(f"memfabric_hybrid.bm.{cls}.{a} does not exist")
            elif getattr(real_obj, a) != getattr(fake_obj, a):
                problems.append(
                    f"{cls}.{a}: stand-in default {getattr(fake_obj, a)!r} != real {getattr(real_obj, a)!r}"
                )
    for name in fake_mod.BM_ENUMS:
        if not hasattr(real_bm, name):
            problems.append(f"memfabric_hybrid.bm.{name} does not exist")
            continue
        problems += compare_enum(getattr(real_bm, name), getattr(fake_mod.bm, name))
    return problems


def test_the_real_package_is_the_real_one():
    assert not getattr(real, "__fake__", False)
    assert doc_signatures(real_bm.BigMemory.copy_data, "copy_data")  # the parser reads real docs


def test_stand_in_matches_the_installed_memfabric_hybrid():
    assert all_problems() == []


def test_every_name_the_stand_in_defines_is_checked():
    """Public callables of the stand-in's ``bm`` classes are all in the checked lists."""
    for cls, methods in fake.BM_METHODS.items():
        mine = {n for n, v in vars(getattr(fake.bm, cls)).items() if callable(v) and not n.startswith("_")}
        assert mine == set(methods), (cls, mine ^ set(methods))
    bm_funcs = {n for n, v in vars(fake.bm).items() if inspect.isfunction(v)}
    assert bm_funcs == set(fake.BM_FUNCTIONS)
    bm_types = {n for n, v in vars(fake.bm).items() if isinstance(v, type)}
    assert bm_types == set(fake.BM_ENUMS) | set(fake.BM_METHODS) | set(fake.BM_ATTRIBUTES)


# ------------------------------------------------------------------ negative controls
def test_a_drifted_parameter_name_is_detected():
    def copy_data(self, src, dst_ptr, size, type, flags=0, stream=0):  # "src" instead of "src_ptr"
        return 0

    problems = compare_callable(real_bm.BigMemory.copy_data, "copy_data", copy_data, method=True)
    assert problems and "src" in problems[0]


def test_a_drifted_default_is_detected():
    def peer_rank_ptr(self, peer_rank, mem_type=fake.BmMemType.HOST):  # real default: DEVICE
        return 0

    problems = compare_callable(real_bm.BigMemory.peer_rank_ptr, "peer_rank_ptr", peer_rank_ptr, method=True)
    assert problems and "HOST" in problems[0]

    def create2(id, local_dram_size, max_dram_size=0):  # a default the real one lacks, others missing
        return None

    assert compare_callable(real_bm.create2, "create2", create2, method=False)


def test_a_renamed_enum_member_is_detected():
    class BmCopyType(enum.IntEnum):
        L2G = 0
        G2L = 1
        D2H = 2  # real: G2H

    assert compare_enum(real_bm.BmCopyType, BmCopyType)

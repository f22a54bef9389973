"""The miss-copy kernel (``sao_copy_miss_rows``) on the functional model against its spec.

Each case builds a batch of entries with miss lists, runs the kernel's own C++ with its
host tiling on simulated cores (vector cores in forward and reversed order) and compares
the target buffer, as int16 words (NaN bit patterns in untouched slots included), with
the spec written out entry by entry: ``hot[rows[b], miss_slots[b, i]] =
host[token_table[rows[b], miss_tokens[b, i]]]`` for ``i < miss_count[b]``, every other
element unchanged. The entries cover first fills (up to ``W`` misses, several copy
rounds of ``kMissBatch`` rows), entries without misses, padding entries sharing a sink
row, entries in any order of rows, list widths ``K`` and ``n x K`` (verify rows, the
overflow area), row widths that are and are not a multiple of the 32-byte UB alignment,
and core counts where a core takes several entries.
"""

from __future__ import annotations

import time
from typing import List, Optional

import torch

from . import model as km
from .functional import KernelResult

#: (entries, state rows, hot slots, list width, row width, cube cores, padding entries)
CASES = (
    dict(entries=5, rows=8, hot=64, width=16, dim=576, aic=24, padding=1),
    dict(entries=6, rows=6, hot=48, width=48, dim=576, aic=1, padding=0),  # a core takes several entries
    dict(entries=4, rows=9, hot=40, width=40, dim=24, aic=2, padding=2),  # 48-byte rows: UB stride padded
    dict(entries=3, rows=4, hot=256, width=128, dim=576, aic=24, padding=0),  # verify rows: n x K lists
    dict(entries=33, rows=40, hot=32, width=32, dim=576, aic=4, padding=3),  # a batch over 8 vector cores
)


def _case_inputs(g: torch.Generator, entries: int, rows: int, hot: int, width: int, dim: int, padding: int):
    """Host rows, a NaN-patterned target, rows (real ones distinct, padding on the sink row
    ``rows - 1`` with no misses), miss lists with counts ``0 .. width`` and a token table."""
    host_rows, max_ctx = 4 * rows * hot, 3 * hot
    host = torch.randn(host_rows, dim, generator=g).to(torch.bfloat16)
    target = torch.randint(-32768, 32767, (rows, hot, dim), generator=g, dtype=torch.int16).view(torch.bfloat16)
    real = entries - padding
    batch_rows = torch.randperm(rows - 1, generator=g)[:real].tolist() + [rows - 1] * padding
    counts = [width, 0] + [int(torch.randint(1, width + 1, (1,), generator=g)) for _ in range(max(0, real - 2))]
    counts = counts[:real] + [0] * padding
    tokens = torch.full((entries, width), -1, dtype=torch.int32)
    slots = torch.full((entries, width), -1, dtype=torch.int32)
    for b, n in enumerate(counts):
        tokens[b, :n] = torch.randperm(max_ctx, generator=g)[:n].to(torch.int32)
        slots[b, :n] = torch.randperm(hot, generator=g)[:n].to(torch.int32)
    table = torch.randint(0, host_rows, (rows, max_ctx), generator=g, dtype=torch.int32)
    return (
        host,
        target,
        torch.tensor(batch_rows, dtype=torch.int32),
        tokens,
        slots,
        torch.tensor(counts, dtype=torch.int32),
        table,
    )


def spec(host, target, rows, tokens, slots, counts, table) -> torch.Tensor:
    """The copy written out entry by entry (the op's definition)."""
    out = target.clone()
    for b in range(rows.shape[0]):
        r = int(rows[b])
        for i in range(int(counts[b])):
            out[r, int(slots[b, i])] = host[int(table[r, int(tokens[b, i])])]
    return out


def _runs(m: km.KernelModel, inputs, aic: int) -> List[torch.Tensor]:
    """The target after the kernel, cores in forward then reversed order."""
    host, target, rows, tokens, slots, counts, table = inputs
    m.aic = aic
    launch = m.tile_copy_rows(
        entries=rows.shape[0],
        row_dim=host.shape[1],
        hot_tokens=target.shape[1],
        miss_width=tokens.shape[1],
        max_ctx=table.shape[1],
    )
    outs = []
    for reverse in (False, True):
        got = target.clone()
        cores = launch.block_dim * km.TASK_RATION
        order = list(reversed(range(cores))) if reverse else None
        m.run(km.COPY_ROWS, [host, got, rows, tokens, slots, counts, table], launch, order)
        outs.append(got)
    return outs


def check_copy_rows(m: km.KernelModel, *, seed: int = 0, cases: Optional[tuple] = None) -> KernelResult:
    """Every case of :data:`CASES` (or ``cases``), bit-exact against :func:`spec`."""
    res = KernelResult("sao_copy_miss_rows")
    t0 = time.monotonic()
    for i, c in enumerate(cases or CASES):
        g = torch.Generator().manual_seed(seed * 100 + i)
        inputs = _case_inputs(g, c["entries"], c["rows"], c["hot"], c["width"], c["dim"], c["padding"])
        want = spec(*inputs)
        try:
            outs = _runs(m, inputs, c["aic"])
        except km.ModelFault as exc:
            res.failures.append(f"miss copy {c}: model fault: {exc}")
            res.bit_exact = False
            continue
        for got, tag in zip(outs, ("", "reversed core order: ")):
            differs = (got.view(torch.int16) != want.view(torch.int16)).any(-1)
            if bool(differs.any()):
                res.failures.append(f"miss copy {c}: {tag}{int(differs.sum())} rows differ from the spec")
                res.bit_exact = False
        res.cases += 1
        res.count("copied_rows", int(inputs[5].sum()))
        res.count("entries_without_misses", int((inputs[5] == 0).sum()))
    res.seconds = time.monotonic() - t0
    return res

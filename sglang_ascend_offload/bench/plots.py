"""Figures of ``size-hot`` and ``bench decode`` (matplotlib, written as PNG).

matplotlib is imported only when a figure is asked for; without it the commands
stop with an error that says how to install it (no silent skip).
"""

from __future__ import annotations

from typing import Any, Dict


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - matplotlib is in requirements-cpu.txt
        raise RuntimeError(
            "--plot needs matplotlib: pip install matplotlib (scripts/requirements-cpu.txt has it)"
        ) from exc
    return plt


def plot_size_hot(result: Dict[str, Any], path: str, title: str = "") -> None:
    """Hit rate vs ``hot_tokens``: the stack-LRU curve at every size, the sampled
    policies and the optimum as markers, the recommendation as a vertical line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    sizes = result["hot_tokens"]
    ax.plot(sizes, result["lru_hit_rate"], label="LRU (every size, stack distances)", color="tab:blue")
    markers = {"lru": ("o", "tab:blue"), "belady": ("*", "black")}
    others = iter(["s", "^", "D", "v", "P", "X"])
    for name, per_size in result["sampled_hit_rate"].items():
        xs = [int(h) for h in per_size]
        ys = [per_size[h] for h in per_size]
        m, c = markers.get(name, (next(others, "x"), None))
        label = {"lru": "LRU (engine, replayed)", "belady": "optimum (Belady)"}.get(name, name)
        ax.plot(xs, ys, linestyle="--" if name != "lru" else "none", marker=m, color=c, label=label)
    rec = result.get("recommended")
    if rec and rec.get("hot_tokens"):
        ax.axvline(
            rec["hot_tokens"],
            color="tab:red",
            linestyle=":",
            label=f"recommended {rec['hot_tokens']} (target {rec['target_hit_rate']:.3f})",
        )
    k = result["top_k"]
    ax.axvline(2 * k, color="grey", linewidth=0.6)
    ax.set_xlabel(f"hot_tokens (top-k = {k}; grey line: 2 x top-k)")
    ax.set_ylabel("hit rate")
    ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(
        title
        or f"hit rate vs hot-buffer size ({result['steps']} steps, {result['layers']} layers, "
        f"{result['active_rows']} active rows)"
    )
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_decode_table(r: Dict[str, Any], path: str) -> None:
    """The side-by-side table of ``bench decode`` as bars: misses of the engine, the
    baselines, the optimum and every policy at the same capacity."""
    plt = _pyplot()
    names = ["this engine", "topk_reload", "topk_cache", "optimum"]
    values = [
        r["misses"],
        r["baselines"]["topk_reload"]["misses"],
        r["baselines"]["topk_cache"]["misses"],
        r["opt_misses"],
    ]
    for name, p in r["policies"].items():
        names.append(name)
        values.append(p["misses"])
    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    colors = ["tab:red", "tab:grey", "tab:grey", "black"] + ["tab:blue"] * (len(names) - 4)
    bars = ax.bar(range(len(names)), values, color=colors)
    for bar, v in zip(bars, values):
        ratio = v / r["misses"] if r["misses"] else float("nan")
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v}\n{ratio:.2f}x", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("misses (rows copied host -> device)")
    ax.set_title(
        f"bench decode: {r['steps']} steps x {r['layers']} layers x {r['rows']} rows, top-k {r['top_k']}, "
        f"hot {r['hot_tokens']}, engine policy {r['policy']}",
        fontsize=9,
    )
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_capacity(result: Dict[str, Any], path: str) -> None:
    """``bench serve --capacity``: output tok/s (left) and peak running requests (right)
    against concurrency, offload and no offload, with the pool-limited levels marked."""
    plt = _pyplot()
    fig, (tput, running) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=110)
    servers = result["servers"]
    for name, color in (("no_offload", "tab:gray"), ("offload", "tab:blue")):
        levels = [r for r in result["runs"] if r["server"] == name and r.get("phase", "sweep") == "sweep"]
        xs = [r["concurrency"] for r in levels]
        label = f"{name.replace('_', ' ')} (max_total_num_tokens {servers[name]['max_total_num_tokens']})"
        tput.plot(xs, [r["output_tokens_per_s"] or 0 for r in levels], marker="o", color=color, label=label)
        running.plot(xs, [r["peak_running"] for r in levels], marker="o", color=color, label=name.replace("_", " "))
        limited = [r for r in levels if r["pool_limited"]]
        tput.scatter(
            [r["concurrency"] for r in limited],
            [r["output_tokens_per_s"] or 0 for r in limited],
            s=140,
            facecolors="none",
            edgecolors="tab:red",
            zorder=3,
        )
    running.plot(xs, xs, linestyle=":", color="black", label="clients")
    tput.scatter([], [], s=140, facecolors="none", edgecolors="tab:red", label="pool-limited")
    for ax, ylabel in ((tput, "output tokens / s"), (running, "peak running requests")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.set_xlabel("concurrency (clients)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    load = result["load"]
    fig.suptitle(
        f"Same device KV budget ({result['device_kv_budget'] or 'SGLang profile'}): "
        f"{load['input_len']} -> {load['output_len']} tokens, {result['model']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

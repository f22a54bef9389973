"""``bench serve``: served throughput and latency with sparse decode offload on and off,
with and without decode graphs and speculative decoding, side by side in one run.

Each selected run launches a real SGLang server (``python -m sglang.launch_server``,
:class:`~sglang_ascend_offload.testing.servers.ServerProcess`), alone on the machine
(one after another: no idle server of another run competes for the CPU), sends it
one warm-up request and then the same load, and stops it:

* ``--clients`` concurrent clients, ``--requests`` requests in all, each a seeded
  prompt of ``--input-len`` token ids (prompt ``i`` is the same in every run) asking
  for ``--output-len`` tokens, greedy, ``ignore_eos``, streamed;
* ``--rounds`` passes of that load (default 1); throughput is the median over rounds,
  latency percentiles pool every round's requests; outputs compare round 1.

With ``--interleave`` every server stays up for the whole run (started one after
another) and each round goes to each server in turn, the order rotating by one per
round: a ratio between two runs then compares rounds taken minutes apart at most,
under the same drift of a shared machine's load (idle servers sleep:
``--sleep-on-idle``).

Runs are named ``[no_]offload[_eager|_graph][_spec][_hotH][_mrrN]``:

* ``offload``: ``--enable-sparse-decode-offload`` with ``--offload-config``;
* ``graph``: decode graphs. On CPU (the default, the tiny DSA fixture) that is SGLang's
  CPU graph runner, which captures decode only with ``--enable-torch-compile``
  (``--graph-args``); on an NPU node (``--model-path``) graphs are SGLang's default and
  ``eager`` adds ``--disable-cuda-graph``. Neither ``_eager`` nor ``_graph``: eager;
* ``spec``: speculative decoding (``--spec-args``: NextN, 3 draft steps, 4 draft tokens),
  served from ``--spec-model-path`` (default on CPU: the NextN fixture
  ``tests/fixtures/tiny_dsa_mtp``; its target layers are the plain fixture's). The
  fixture's dummy draft layer never agrees with its target, so on CPU these servers run
  SGLang's acceptance simulation by default (``--spec-env``; the run's ``server_env``
  says so): its ``accept_length`` is then the simulated one and its outputs differ from
  the non-speculative runs' (``token_agreement``), while offload on vs off with the same
  simulation must still match exactly;
* ``hotH`` (offload runs): ``hot_tokens`` H for that run, over ``--offload-config``, so two
  hot-buffer sizes run side by side (e.g. ``offload_spec,offload_spec_hot256``: the
  default 2 x top-k and the worst case 4 verify rows x top-k at MTP-3);
* ``mrrN``: ``--max-running-requests N`` for that run (else ``--max-running-requests``).

``--trained`` serves the trained checkpoint ``tests/fixtures/tiny_dsa_trained`` on CPU
instead (real weights and tokenizer, trained by ``scripts/train_tiny_dsa.py``, with its
own trained NextN layer for the ``spec`` runs): prompts are cut from its held-out
standard-library text instead of random ids, speculative runs measure SGLang's real
acceptance (no simulation unless ``--spec-env`` asks for it), and the offload runs use
the resolved default hot buffer (2 x top-k, with or without verify rows) unless
``--offload-config`` or ``_hotH`` says otherwise. Its context is 2,048 tokens: ``--input-len`` +
``--output-len`` must fit.

The default selection (:data:`DEFAULT_RUNS`) is offload eager, offload and no offload
with decode graphs, and offload and no offload with graphs and speculative decoding,
plus ``no_offload_eager``, the plain no-offload run that ``token_agreement`` is
measured against and that ``offload_eager`` must match.

Per run (``--json``: one entry of ``runs``): ``requests``, ``completed`` (requests that
returned every asked token, summed over rounds), ``output_tokens_per_s`` (output tokens
of completed requests over the load's wall time), ``decode_tokens_per_s`` (tokens after
each request's first over the decode window: first request's first token to the last
request's last token), ``ttft_ms_p50``, ``itl_ms_p50`` / ``itl_ms_p99`` (per output
token after the first: each streamed chunk's gap divided over the tokens it carried),
``server_cpu_ms_per_token`` (CPU time of all the server's processes per output token,
median over rounds: unlike wall time it does not grow when other jobs share the cores),
``accept_length`` (speculative runs: output tokens over verify steps, SGLang's
``spec_verify_ct``), ``hot_tokens`` (offload runs: the run's ``_hotH``, else what its
config sets, ``null`` for the default), ``overflow_rounds`` / ``overflow_positions``
(offload runs, from the server's last summary line: requests' verify rounds, per layer,
whose union exceeded the hot buffer, and the positions served from the overflow area),
``token_agreement`` (fraction of the plain no-offload run's output tokens that this run
reproduced at the same position of the same request; compiled or speculative arithmetic
may legitimately differ), ``reference`` / ``identical_to_reference`` (the no-offload run
with the same graph and speculation settings, preferring the same
``--max-running-requests``, and whether every output equals it). A run that cannot start (a
configuration not supported yet) keeps its entry with ``error``: the server's own
startup error from its log. Offload runs whose ``--offload-config`` turns on shadow
verification (``verify_sample_rate``) also report ``shadow_checks``,
``shadow_mismatches``, ``shadow_ms`` and ``shadow_share_of_server_cpu`` (the checks'
time over the server's CPU time during the rounds).

``identical_tokens`` is true when every offload run has such a no-offload counterpart
in the selection and reproduces its greedy outputs exactly (and no run failed).
``max_running_requests_ratios``: for runs that differ only in ``--max-running-requests``
(e.g. ``--runs offload_mrr4,offload_mrr2048``), the smallest over the largest's decode
and output tokens/s (with offload, 2048 must stay within 1.25 x of 4 for the same
live load: per-step work follows the live requests, not the request-slot capacity),
the largest over the smallest's server CPU time per token
(``server_cpu_per_token_ratio``: the same comparison as a cost, robust to a shared
machine) and whether their outputs are identical.

Progress goes to stderr; ``--json`` prints one JSON document on stdout, otherwise a
table. Exit status 0 when every run completed every request and ``identical_tokens``.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import serve_capacity, served_load
from .served_startup import model_vocab, startup_error

DEFAULT_RUNS = (
    "no_offload_eager",
    "no_offload_graph",
    "offload_eager",
    "offload_graph",
    "offload_graph_spec",
    "no_offload_graph_spec",
)
RUN_NAME = re.compile(r"^(no_offload|offload)(_eager|_graph)?(_spec)?(?:_hot(\d+))?(?:_mrr(\d+))?$")
DEFAULT_OFFLOAD_CONFIG = json.dumps({"hot_tokens": 64, "metrics_log_interval_s": 1.0})
# --trained: no hot_tokens, so the checkpoint's top-k (64) and the verify rows size it.
TRAINED_OFFLOAD_CONFIG = json.dumps({"metrics_log_interval_s": 1.0})
TRAINED_CONTEXT = 2048  # --context-length of the trained checkpoint's CPU servers
# DeepSeek-V3.2's NextN defaults in SGLang 0.5.23 (tests/sglang/e2e/test_speculative_offload_e2e_cpu.py).
DEFAULT_SPEC_ARGS = (
    "--speculative-algorithm NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 "
    "--speculative-num-draft-tokens 4"
)
# The fixture's dummy NextN layer never agrees with its target (accept length 1.0): on
# CPU, speculative runs use SGLang's own acceptance simulation by default (the first
# draft of each round accepted, the bonus token the target's own prediction), so
# accepted and rejected verify rows both occur. ``--spec-env none`` turns it off.
DEFAULT_CPU_SPEC_ENV = "SGLANG_SIMULATE_ACC_LEN=2,SGLANG_SIMULATE_ACC_TOKEN_MODE=real-draft-token"
OFFLOAD_SUMMARY = "sparse-decode-offload:"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--runs",
        default=None,
        help="comma-separated runs, each [no_]offload[_eager|_graph][_spec][_hotH][_mrrN] "
        f"(default {','.join(DEFAULT_RUNS)})",
    )
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--requests", type=int, default=None, help="requests per round (default 2 x --clients)")
    p.add_argument(
        "--input-len",
        type=int,
        default=None,
        help=f"prompt tokens per request (default 64; --capacity: {serve_capacity.DEFAULT_INPUT_LEN})",
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=None,
        help=f"output tokens per request (default 32; --capacity: {serve_capacity.DEFAULT_OUTPUT_LEN})",
    )
    p.add_argument("--rounds", type=int, default=1, help="passes of the load per run (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="keep every run's server up at once and send each round to each server in turn "
        "(rotating order): the runs share the machine's load drift (for ratios such as "
        "offload_mrr4,offload_mrr2048); default: one server at a time",
    )
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=None,
        help="--max-running-requests of every run without an _mrrN suffix (default 4; --capacity: "
        f"both servers, default {serve_capacity.DEFAULT_MAX_RUNNING})",
    )
    p.add_argument(
        "--model-path",
        default=None,
        help="a real checkpoint (NPU node): servers run on the device with SGLang's defaults plus "
        "--server-arg; default: the tiny DSA fixture on CPU",
    )
    p.add_argument(
        "--spec-model-path",
        default=None,
        help="model of the speculative runs (default: --model-path, or the NextN fixture "
        "tests/fixtures/tiny_dsa_mtp on CPU)",
    )
    p.add_argument(
        "--trained",
        action="store_true",
        help="serve the trained checkpoint tests/fixtures/tiny_dsa_trained on CPU (prompts from its "
        "held-out text, its own NextN layer, real speculative acceptance)",
    )
    p.add_argument(
        "--offload-config",
        default=None,
        help=f"--sparse-decode-offload-config of the offload runs (default {DEFAULT_OFFLOAD_CONFIG}; "
        f"with --trained {TRAINED_OFFLOAD_CONFIG})",
    )
    p.add_argument(
        "--graph-args",
        default=None,
        help="server arguments of graph runs (CPU default: --enable-torch-compile "
        "--torch-compile-max-bs C --cuda-graph-bs-decode 1 2 .. C with C = --clients)",
    )
    p.add_argument(
        "--spec-args",
        default=DEFAULT_SPEC_ARGS,
        help=f"server arguments of speculative runs (default {DEFAULT_SPEC_ARGS!r})",
    )
    p.add_argument(
        "--spec-env",
        default=None,
        metavar="KEY=VALUE,...",
        help="environment of speculative runs' servers (CPU default: SGLang's acceptance simulation "
        f"{DEFAULT_CPU_SPEC_ENV}; 'none': real acceptance)",
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="extra server arguments for every run (repeatable; split like a shell)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=900.0,
        help="seconds a server may take to become healthy (graph capture compiles: minutes on a "
        "loaded 2-core machine; default 900)",
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--log-dir", default=None, help="server logs (default: a new temporary folder)")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    serve_capacity.add_arguments(p)


def _fill_defaults(args: argparse.Namespace) -> bool:
    """Defaults that depend on ``--capacity``; whether ``--runs`` was given."""
    runs_given = args.runs is not None
    capacity = getattr(args, "capacity", False)
    if args.runs is None:
        args.runs = ",".join(DEFAULT_RUNS)
    if args.input_len is None:
        args.input_len = serve_capacity.DEFAULT_INPUT_LEN if capacity else 64
    if args.output_len is None:
        args.output_len = serve_capacity.DEFAULT_OUTPUT_LEN if capacity else 32
    if args.max_running_requests is None:
        args.max_running_requests = serve_capacity.DEFAULT_MAX_RUNNING if capacity else 4
    return runs_given


@dataclass(frozen=True)
class RunSpec:
    """One served configuration (a parsed run name)."""

    name: str
    offload: bool
    graph: bool
    speculative: bool
    max_running_requests: int
    hot_tokens: Optional[int] = None  # _hotH: this run's hot_tokens over --offload-config

    @property
    def settings(self) -> Tuple[bool, bool]:
        return self.graph, self.speculative


@dataclass(frozen=True)
class LoadSpec:
    """The load every run gets."""

    clients: int
    requests: int
    input_len: int
    output_len: int
    rounds: int
    seed: int
    vocab: int = served_load.VOCAB
    #: "random": seeded random ids; "heldout": windows of the trained checkpoint's held-out text
    prompt_source: str = "random"

    def prompts(self) -> List[List[int]]:
        if self.prompt_source == "heldout":
            return heldout_prompts(self.requests, self.input_len, self.seed)
        return [
            served_load.random_prompt(self.input_len, self.seed * 1_000_003 + i, self.vocab)
            for i in range(self.requests)
        ]


def heldout_prompts(count: int, length: int, seed: int) -> List[List[int]]:
    """``count`` prompts of ``length`` token ids cut from the trained checkpoint's held-out
    evaluation text (its windows concatenated, 4,096 tokens of standard-library source),
    each starting at a different seeded offset."""
    import random

    from ..testing.servers import TINY_DSA_TRAINED

    windows = json.loads((TINY_DSA_TRAINED / "heldout_eval.json").read_text())["windows"]
    text = [t for w in windows for t in w]
    if length > len(text):
        raise ValueError(f"--input-len {length} exceeds the held-out text ({len(text)} tokens)")
    rng = random.Random(seed)
    return [text[start : start + length] for start in (rng.randrange(len(text) - length + 1) for _ in range(count))]


@dataclass
class RunResult:
    """One run's entry of ``runs`` (field meanings: module docstring). Times in ms,
    throughputs in tokens/s; ``None`` where a value does not exist (no completed request,
    no speculation, a failed run)."""

    name: str
    offload: bool
    graph: bool
    speculative: bool
    max_running_requests: int
    requests: int
    hot_tokens: Optional[int] = None
    completed: int = 0
    output_tokens_per_s: Optional[float] = None
    decode_tokens_per_s: Optional[float] = None
    ttft_ms_p50: Optional[float] = None
    ttft_ms_p99: Optional[float] = None
    itl_ms_p50: Optional[float] = None
    itl_ms_p99: Optional[float] = None
    accept_length: Optional[float] = None
    token_agreement: Optional[float] = None
    reference: Optional[str] = None
    identical_to_reference: Optional[bool] = None
    deterministic_across_rounds: Optional[bool] = None
    rounds_output_tokens_per_s: List[float] = field(default_factory=list)
    rounds_decode_tokens_per_s: List[float] = field(default_factory=list)
    server_cpu_ms_per_token: Optional[float] = None
    rounds_server_cpu_ms_per_token: List[float] = field(default_factory=list)
    #: shadow verification (offload runs with verify_sample_rate > 0, from the server's last
    #: summary line): rows checked, mismatches, the checks' milliseconds, and that time over
    #: the server's CPU time during the rounds (an upper bound: it includes the warm-up's checks)
    shadow_checks: Optional[int] = None
    shadow_mismatches: Optional[int] = None
    shadow_ms: Optional[float] = None
    shadow_share_of_server_cpu: Optional[float] = None
    #: speculative offload runs (the server's last summary line): request rounds (per layer)
    #: whose verify rows' union exceeded the hot buffer, and the positions of the overflow area
    overflow_rounds: Optional[int] = None
    overflow_positions: Optional[int] = None
    startup_s: Optional[float] = None
    offload_summary: Dict[str, str] = field(default_factory=dict)
    server_args: List[str] = field(default_factory=list)
    server_env: Dict[str, str] = field(default_factory=dict)
    log: Optional[str] = None
    error: Optional[str] = None
    request_errors: List[str] = field(default_factory=list)


def parse_runs(text: str, default_mrr: int) -> List[RunSpec]:
    """Run names -> specs; ``ValueError`` naming every unknown or repeated name."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if not RUN_NAME.match(n)]
    if bad:
        raise ValueError(
            f"unknown runs {bad}: each is [no_]offload[_eager|_graph][_spec][_hotH][_mrrN], "
            f"e.g. {','.join(DEFAULT_RUNS)},offload_mrr2048"
        )
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"runs named more than once: {dup}")
    if not names:
        raise ValueError("--runs is empty")
    out = []
    for n in names:
        m = RUN_NAME.match(n)
        mrr = int(m.group(5)) if m.group(5) else default_mrr
        if mrr < 1:
            raise ValueError(f"run {n}: max running requests must be >= 1")
        hot = int(m.group(4)) if m.group(4) else None
        if hot is not None and (m.group(1) != "offload" or hot < 1):
            raise ValueError(f"run {n}: _hotH sets an offload run's hot_tokens (>= 1)")
        out.append(RunSpec(n, m.group(1) == "offload", m.group(2) == "_graph", m.group(3) == "_spec", mrr, hot))
    return out


def default_graph_args(clients: int) -> List[str]:
    """CPU decode graphs: SGLang's CPU graph runner (``--enable-torch-compile``), one
    captured batch size per power of two up to ``clients`` (and ``clients`` itself)."""
    sizes = sorted({1 << i for i in range(max(1, clients).bit_length()) if 1 << i <= clients} | {max(1, clients)})
    return [
        "--enable-torch-compile",
        "--torch-compile-max-bs",
        str(max(sizes)),
        "--cuda-graph-bs-decode",
        *map(str, sizes),
    ]


def server_args(spec: RunSpec, args: argparse.Namespace) -> Tuple[List[str], List[str], bool]:
    """``(base_args, extra_args, cpu)`` of ``spec``'s server."""
    from ..testing.servers import FIXTURES, IDLE_SLEEP, TINY_DSA, TRAINED_SERVER_ARGS, fixture_args

    cpu = args.model_path is None
    extra: List[str] = ["--max-running-requests", str(spec.max_running_requests)]
    if cpu:
        model = TINY_DSA
        if spec.speculative:
            model = Path(args.spec_model_path) if args.spec_model_path else FIXTURES / "tiny_dsa_mtp"
        base = list(TRAINED_SERVER_ARGS) if getattr(args, "trained", False) else fixture_args(model)
        extra += ["--chunked-prefill-size", "128"] + IDLE_SLEEP
        if spec.graph:  # the CPU graph runner (fixture_args disables CUDA graphs, which CPU has none of)
            base = [a for a in base if a != "--disable-cuda-graph"]
            extra += shlex.split(args.graph_args) if args.graph_args is not None else default_graph_args(args.clients)
    else:
        model = args.spec_model_path if (spec.speculative and args.spec_model_path) else args.model_path
        base = ["--model-path", str(model)]
        if spec.graph:
            extra += shlex.split(args.graph_args or "")
        else:
            extra += ["--disable-cuda-graph"]
    if spec.offload:
        extra += ["--enable-sparse-decode-offload", "--sparse-decode-offload-config", offload_config(args, spec)]
    if spec.speculative:
        extra += shlex.split(args.spec_args)
    for item in args.server_arg:
        extra += shlex.split(item)
    return base, extra, cpu


def offload_config(args: argparse.Namespace, spec: Optional[RunSpec] = None) -> str:
    """``--sparse-decode-offload-config`` of an offload run (``--offload-config`` or the
    default; the run's ``_hotH`` sets ``hot_tokens`` over it)."""
    if args.offload_config is not None:
        text = args.offload_config
    else:
        text = TRAINED_OFFLOAD_CONFIG if getattr(args, "trained", False) else DEFAULT_OFFLOAD_CONFIG
    if spec is None or spec.hot_tokens is None:
        return text
    return json.dumps({**json.loads(text), "hot_tokens": spec.hot_tokens})


def spec_env(args: argparse.Namespace) -> Dict[str, str]:
    """Environment of speculative runs' servers (``--spec-env``). Simulated acceptance is
    the default only for the random-weight CPU fixture, whose draft layer never agrees."""
    simulate = args.model_path is None and not getattr(args, "trained", False)
    text = args.spec_env if args.spec_env is not None else (DEFAULT_CPU_SPEC_ENV if simulate else "")
    if text.strip().lower() in ("", "none"):
        return {}
    out = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or not key:
            raise ValueError(f"--spec-env: {item!r} is not KEY=VALUE")
        out[key] = value
    return out


def _summary(log: Optional[Path]) -> Dict[str, str]:
    """``key=value`` pairs of the last offload summary line of a server log."""
    try:
        lines = [x for x in log.read_text(errors="replace").splitlines() if OFFLOAD_SUMMARY in x] if log else []
    except OSError:
        return {}
    return dict(re.findall(r"([\w/]+)=([^\s]+)", lines[-1].split(OFFLOAD_SUMMARY, 1)[1])) if lines else {}


def _progress(msg: str) -> None:
    print(f"[bench serve] {msg}", file=sys.stderr, flush=True)


def _ms(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(v * 1e3, 3)


class Measurement:
    """One run's server and what its rounds measured (fills a :class:`RunResult`)."""

    def __init__(self, spec: RunSpec, load: LoadSpec, args: argparse.Namespace, log_dir: Path):
        from ..testing.servers import ServerProcess

        base, extra, cpu = server_args(spec, args)
        self.spec, self.load, self.request_timeout = spec, load, args.request_timeout
        self.result = RunResult(
            spec.name,
            spec.offload,
            spec.graph,
            spec.speculative,
            spec.max_running_requests,
            requests=load.requests * load.rounds,
            hot_tokens=json.loads(offload_config(args, spec)).get("hot_tokens") if spec.offload else None,
            server_args=extra,
            log=str(log_dir / f"{spec.name}.log"),
        )
        env = spec_env(args) if spec.speculative else {}
        self.result.server_env = env
        self.server = ServerProcess(
            extra,
            log_path=Path(self.result.log),
            base_args=base,
            cpu=cpu,
            env=env,
            startup_timeout_s=args.startup_timeout,
        )
        self.outputs: Optional[List[Optional[List[int]]]] = None  # round 1's output ids per prompt
        self._ttfts: List[float] = []
        self._itls: List[float] = []
        self._spec_tokens = 0
        self._spec_steps = 0
        self._same = True
        self._rounds = 0
        self._server_cpu_ms = 0.0  # server CPU time during the rounds (all processes)

    @property
    def failed(self) -> bool:
        return self.result.error is not None

    def start(self) -> bool:
        """Start the server and send one warm-up request; ``False`` (and ``error`` set
        to the server's own startup error) when it does not come up or fails it."""
        from ..testing.servers import PortInUse

        _progress(f"{self.spec.name}: starting ({' '.join(self.result.server_args)})")
        try:
            self.server.start()
            self.result.startup_s = round(self.server.startup_s or 0.0, 1)
            served_load.stream_generate(
                self.server.url,
                served_load.random_prompt(self.load.input_len, -1, self.load.vocab),
                self.load.output_len,
                timeout_s=self.request_timeout,
            )
        except (RuntimeError, TimeoutError, PortInUse, *served_load.REQUEST_ERRORS) as exc:
            self.result.error = startup_error(exc, self.server.log_path)
            _progress(f"{self.spec.name}: did not start: {self.result.error}")
            self.stop()
            return False
        _progress(f"{self.spec.name}: up in {self.result.startup_s:.0f} s")
        return True

    def round(self, prompts: Sequence[List[int]]) -> None:
        """One pass of the load."""
        from ..testing.servers import cpu_seconds

        load, result = self.load, self.result
        cpu0 = cpu_seconds(self.server.pids())
        res, sent = served_load.run_load(
            self.server.url, prompts, load.output_len, load.clients, timeout_s=self.request_timeout
        )
        cpu = sum(cpu_seconds(self.server.pids()).values()) - sum(cpu0.values())
        done = res.completed(load.output_len)
        tokens = sum(o.tokens for o in done)
        if tokens:
            result.rounds_server_cpu_ms_per_token.append(round(cpu * 1e3 / tokens, 4))
        self._server_cpu_ms += cpu * 1e3
        result.completed += len(done)
        result.request_errors += res.errors[: max(0, 10 - len(result.request_errors))]
        tps, dtps = res.output_tokens_per_s(load.output_len), res.decode_tokens_per_s(load.output_len, sent)
        if tps is not None:
            result.rounds_output_tokens_per_s.append(round(tps, 3))
        if dtps is not None:
            result.rounds_decode_tokens_per_s.append(round(dtps, 3))
        for o in done:
            self._ttfts.append(o.ttft_s)
            self._itls.extend(o.inter_token_s())
            verify = o.meta_info.get("spec_verify_ct")
            if verify:
                self._spec_tokens += o.tokens
                self._spec_steps += int(verify)
        ids = [o.output_ids if o is not None else None for o in res.outputs]
        if self.outputs is None:
            self.outputs = ids
        else:
            self._same = self._same and ids == self.outputs
        self._rounds += 1
        _progress(
            f"{self.spec.name}: round {self._rounds}/{load.rounds}: {len(done)}/{len(prompts)} completed, "
            f"{tps or 0:.1f} output tok/s, {dtps or 0:.1f} decode tok/s"
        )

    def stop(self) -> None:
        self.server.stop()
        if self.spec.offload:
            self.result.offload_summary = _summary(self.server.log_path)

    def finish(self) -> RunResult:
        """Summaries over the rounds (medians of throughput, pooled latency percentiles)."""
        result = self.result
        if result.rounds_output_tokens_per_s:
            result.output_tokens_per_s = round(statistics.median(result.rounds_output_tokens_per_s), 3)
        if result.rounds_decode_tokens_per_s:
            result.decode_tokens_per_s = round(statistics.median(result.rounds_decode_tokens_per_s), 3)
        if result.rounds_server_cpu_ms_per_token:
            result.server_cpu_ms_per_token = round(statistics.median(result.rounds_server_cpu_ms_per_token), 4)
        summary = result.offload_summary
        if summary and result.speculative:  # the summary names overflow once a round overflowed
            result.overflow_rounds = int(summary.get("overflow_rounds", 0))
            result.overflow_positions = int(summary.get("overflow_positions", 0))
        if "shadow_checks" in summary:
            result.shadow_checks = int(summary["shadow_checks"])
            result.shadow_mismatches = int(summary.get("shadow_mismatches", 0))
            result.shadow_ms = float(summary.get("shadow_ms", 0.0))
            if self._server_cpu_ms > 0:
                result.shadow_share_of_server_cpu = round(result.shadow_ms / self._server_cpu_ms, 5)
        result.ttft_ms_p50 = _ms(served_load.percentile(self._ttfts, 50))
        result.ttft_ms_p99 = _ms(served_load.percentile(self._ttfts, 99))
        result.itl_ms_p50 = _ms(served_load.percentile(self._itls, 50))
        result.itl_ms_p99 = _ms(served_load.percentile(self._itls, 99))
        result.accept_length = round(self._spec_tokens / self._spec_steps, 4) if self._spec_steps else None
        result.deterministic_across_rounds = self._same if self._rounds > 1 else None
        if not result.error and result.completed == 0:
            result.error = "no request completed: " + "; ".join(result.request_errors[:3])
        if result.error:
            self.outputs = None
        return result


def run_all(
    specs: Sequence[RunSpec], load: LoadSpec, prompts: Sequence[List[int]], args: argparse.Namespace, log_dir: Path
) -> List[Measurement]:
    """Every run: one after another (start, rounds, stop), or with ``--interleave`` all
    servers up together (started one after another) and each round sent to every
    server in turn, the order rotating by one per round."""
    runs = [Measurement(s, load, args, log_dir) for s in specs]
    if not args.interleave:
        for m in runs:
            if m.start():
                try:
                    for _ in range(load.rounds):
                        m.round(prompts)
                finally:
                    m.stop()
        return runs
    try:
        live = [m for m in runs if m.start()]
        for r in range(load.rounds):
            for i in range(len(live)):
                live[(i + r) % len(live)].round(prompts)
    finally:
        from ..testing.servers import stop_all

        stop_all(*(m.server for m in runs))
        for m in runs:
            if m.spec.offload:
                m.result.offload_summary = _summary(m.server.log_path)
    return runs


def agreement(ours: Sequence[Optional[List[int]]], ref: Sequence[Optional[List[int]]]) -> Optional[float]:
    """Fraction of the reference's output tokens equal at the same position of the same
    request (requests missing from either count as disagreeing)."""
    total = sum(len(r) for r in ref if r is not None)
    if total == 0:
        return None
    equal = 0
    for a, b in zip(ours, ref):
        if a is not None and b is not None:
            equal += sum(1 for x, y in zip(a, b) if x == y)
    return equal / total


def compare(
    specs: Sequence[RunSpec], results: Dict[str, RunResult], outputs: Dict[str, Optional[List[Optional[List[int]]]]]
) -> Tuple[bool, List[str]]:
    """Fill ``token_agreement`` / ``reference`` / ``identical_to_reference``; returns
    ``(identical_tokens, problems)``."""
    problems: List[str] = []
    plain = next(
        (
            s.name
            for s in specs
            if not s.offload and not s.graph and not s.speculative and outputs.get(s.name) is not None
        ),
        None,
    )
    for s in specs:
        res = results[s.name]
        if plain is not None and outputs.get(s.name) is not None:
            a = agreement(outputs[s.name], outputs[plain])
            res.token_agreement = None if a is None else round(a, 6)
        if results[s.name].error:
            problems.append(f"{s.name}: {res.error.splitlines()[0]}")
        if not s.offload:
            continue
        candidates = [c for c in specs if not c.offload and c.settings == s.settings]
        candidates.sort(key=lambda c: c.max_running_requests != s.max_running_requests)
        if not candidates:
            problems.append(
                f"{s.name}: no no-offload run with graph={s.graph}, speculative={s.speculative} "
                "selected to compare with"
            )
            continue
        ref = candidates[0].name
        res.reference = ref
        if outputs.get(s.name) is None or outputs.get(ref) is None:
            problems.append(f"{s.name}: cannot compare with {ref} (a run failed)")
            continue
        res.identical_to_reference = outputs[s.name] == outputs[ref] and all(o is not None for o in outputs[s.name])
        if not res.identical_to_reference:
            problems.append(f"{s.name}: greedy outputs differ from {ref}")
    offload_runs = [s for s in specs if s.offload]
    identical = bool(offload_runs) and not problems
    if not offload_runs:
        problems.append("no offload run selected")
    return identical, problems


def mrr_ratios(
    specs: Sequence[RunSpec], results: Dict[str, RunResult], outputs: Dict[str, Optional[List[Optional[List[int]]]]]
) -> List[Dict[str, Any]]:
    """Smallest over largest ``--max-running-requests`` of runs equal in everything else."""
    groups: Dict[Tuple[bool, bool, bool, Optional[int]], List[RunSpec]] = {}
    for s in specs:
        groups.setdefault((s.offload, s.graph, s.speculative, s.hot_tokens), []).append(s)
    out = []
    for group in groups.values():
        if len({s.max_running_requests for s in group}) < 2:
            continue
        lo = min(group, key=lambda s: s.max_running_requests)
        hi = max(group, key=lambda s: s.max_running_requests)
        a, b = results[lo.name], results[hi.name]

        def ratio(x, y):
            return round(x / y, 4) if x and y else None

        out.append(
            {
                "runs": [lo.name, hi.name],
                "max_running_requests": [lo.max_running_requests, hi.max_running_requests],
                "decode_tokens_per_s_ratio": ratio(a.decode_tokens_per_s, b.decode_tokens_per_s),
                "output_tokens_per_s_ratio": ratio(a.output_tokens_per_s, b.output_tokens_per_s),
                "server_cpu_per_token_ratio": ratio(b.server_cpu_ms_per_token, a.server_cpu_ms_per_token),
                "rounds_decode_tokens_per_s_ratio": [
                    ratio(x, y) for x, y in zip(a.rounds_decode_tokens_per_s, b.rounds_decode_tokens_per_s)
                ],
                "identical_tokens": (outputs.get(lo.name) is not None and outputs.get(lo.name) == outputs.get(hi.name)),
            }
        )
    return out


def run(args: argparse.Namespace) -> Dict[str, Any]:
    specs = parse_runs(args.runs, args.max_running_requests)
    load = LoadSpec(
        clients=args.clients,
        requests=args.requests or 2 * args.clients,
        input_len=args.input_len,
        output_len=args.output_len,
        rounds=args.rounds,
        seed=args.seed,
        vocab=model_vocab(args.model_path, args.trained),
        prompt_source="heldout" if args.trained else "random",
    )
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_serve_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    _progress(
        f"{len(specs)} runs, {load.requests} requests x {load.rounds} rounds, {load.clients} clients, "
        f"{load.input_len} -> {load.output_len} tokens; server logs in {log_dir}"
    )
    prompts = load.prompts()
    t0 = time.monotonic()
    measured = run_all(specs, load, prompts, args, log_dir)
    results = {m.spec.name: m.finish() for m in measured}
    outputs = {m.spec.name: m.outputs for m in measured}
    identical, problems = compare(specs, results, outputs)
    return {
        "runs": [asdict(results[s.name]) for s in specs],
        "identical_tokens": identical,
        "identical_tokens_problems": problems,
        "max_running_requests_ratios": mrr_ratios(specs, results, outputs),
        "load": asdict(load),
        "interleave": bool(args.interleave),
        "model": args.model_path
        or ("tests/fixtures/tiny_dsa_trained (CPU)" if args.trained else "tests/fixtures/tiny_dsa (CPU)"),
        "offload_config": offload_config(args),
        "wall_s": round(time.monotonic() - t0, 1),
        "logs": str(log_dir),
    }


def _fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(res: Dict[str, Any]) -> None:
    load = res["load"]
    print(
        f"bench serve: {load['clients']} clients, {load['requests']} requests x {load['rounds']} rounds, "
        f"{load['input_len']} -> {load['output_len']} tokens, greedy; model {res['model']}"
    )
    print(
        f"{'run':26s} {'mrr':>5s} {'done':>7s} {'out tok/s':>9s} {'dec tok/s':>9s} {'TTFT p50':>8s} "
        f"{'ITL p50':>7s} {'ITL p99':>7s} {'cpu ms/tok':>10s} {'accept':>6s} {'agree':>6s} {'= ref':>5s}"
    )
    for r in res["runs"]:
        same = {True: "yes", False: "NO", None: "-"}[r["identical_to_reference"]]
        print(
            f"{r['name']:26s} {r['max_running_requests']:5d} {r['completed']:3d}/{r['requests']:<3d} "
            f"{_fmt(r['output_tokens_per_s']):>9s} {_fmt(r['decode_tokens_per_s']):>9s} "
            f"{_fmt(r['ttft_ms_p50']):>8s} {_fmt(r['itl_ms_p50']):>7s} {_fmt(r['itl_ms_p99']):>7s} "
            f"{_fmt(r['server_cpu_ms_per_token'], '.2f'):>10s} "
            f"{_fmt(r['accept_length'], '.2f'):>6s} {_fmt(r['token_agreement'], '.3f'):>6s} {same:>5s}"
        )
    for r in res["runs"]:
        if r["error"]:
            print(f"  {r['name']}: {r['error']}")
    for r in res["runs"]:
        if r["overflow_rounds"] is not None:
            hot = r["hot_tokens"] if r["hot_tokens"] is not None else "default"
            print(
                f"{r['name']}: hot_tokens {hot}, accept length {_fmt(r['accept_length'], '.2f')}, overflow rounds "
                f"{r['overflow_rounds']} (request x layer), overflow positions {r['overflow_positions']}"
            )
    base = {r["name"]: r for r in res["runs"]}
    for name in ("offload_graph", "offload_eager"):
        ref = base.get("no_offload_graph" if name == "offload_graph" else "no_offload_eager")
        if name in base and ref and base[name]["output_tokens_per_s"] and ref["output_tokens_per_s"]:
            print(
                f"{name} / {ref['name']} output tok/s: "
                f"{base[name]['output_tokens_per_s'] / ref['output_tokens_per_s']:.3f}"
            )
    for m in res["max_running_requests_ratios"]:
        print(
            f"{m['runs'][0]} / {m['runs'][1]} decode tok/s: {_fmt(m['decode_tokens_per_s_ratio'], '.3f')} "
            f"(output tok/s {_fmt(m['output_tokens_per_s_ratio'], '.3f')}; server CPU per token "
            f"{m['runs'][1]} / {m['runs'][0]} {_fmt(m['server_cpu_per_token_ratio'], '.3f')}; identical tokens "
            f"{m['identical_tokens']})"
        )
    print(f"identical_tokens: {res['identical_tokens']}")
    for p in res["identical_tokens_problems"]:
        print(f"  {p}")
    print(f"server logs: {res['logs']}")


def main(args: argparse.Namespace) -> int:
    runs_given = _fill_defaults(args)
    problems = [
        m
        for bad, m in (
            (args.clients < 1, f"--clients {args.clients} must be >= 1"),
            (args.requests is not None and args.requests < 1, f"--requests {args.requests} must be >= 1"),
            (args.input_len < 1, f"--input-len {args.input_len} must be >= 1"),
            (
                args.output_len < 2,
                f"--output-len {args.output_len} must be >= 2 (inter-token latency needs two tokens)",
            ),
            (args.rounds < 1, f"--rounds {args.rounds} must be >= 1"),
            (args.max_running_requests < 1, f"--max-running-requests {args.max_running_requests} must be >= 1"),
        )
        if bad
    ]
    try:
        parse_runs(args.runs, max(1, args.max_running_requests))
        spec_env(args)
        model_vocab(args.model_path, args.trained)
    except ValueError as exc:
        problems.append(str(exc))
    if args.trained:
        if args.model_path is not None:
            problems.append("--trained serves the CPU checkpoint tests/fixtures/tiny_dsa_trained: drop --model-path")
        if args.spec_model_path is not None:
            problems.append("--trained speculates with the checkpoint's own NextN layer: drop --spec-model-path")
        if args.input_len + args.output_len > TRAINED_CONTEXT:
            problems.append(
                f"--input-len {args.input_len} + --output-len {args.output_len} exceed the trained "
                f"checkpoint's context of {TRAINED_CONTEXT} tokens"
            )
        if args.input_len > 4096:
            problems.append(f"--input-len {args.input_len} exceeds the held-out text (4,096 tokens)")
    if getattr(args, "capacity", False):
        problems += serve_capacity.problems(args, runs_given)
    if problems:
        print("bench serve: " + "; ".join(problems), file=sys.stderr)
        return 2
    if getattr(args, "capacity", False):
        return serve_capacity.main(args)
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print_table(res)
    ok = res["identical_tokens"] and all(r["completed"] == r["requests"] and not r["error"] for r in res["runs"])
    return 0 if ok else 1

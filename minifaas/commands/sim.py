"""``minifaas sim``: simulate a planned deployment under a workload and report what it would do.

    minifaas sim --case paper --load 0.8 --arrivals poisson --duration 3600
    minifaas sim --case paper --bandwidth-schedule 600:6,1500:100 --scheduler      # t and N_p/N_d adapt

The instance counts and threshold come from the planner's solution (flags override them); ``--load`` is a
fraction of its planned throughput. Policy flags name a policy as ``minifaas serve`` does. A flag the run would
not read is refused: synthetic arrivals' with ``--trace``, a trace's without it, a scheduler's while it is off.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from minifaas import figures
from minifaas.commands import arguments, sim_compare
from minifaas.commands.main import user_input
from minifaas.planner.case import PlanCase
from minifaas.planner.model import OperatingPoint
from minifaas.planner.paper import named_case
from minifaas.planner.profile import load_prefill_profile, load_profiles
from minifaas.planner.search import plan
from minifaas.plotting import draw_or_say
from minifaas.policy.codec_policy import CodecEstimate
from minifaas.policy.long_term import LongTermConfig
from minifaas.policy.router import Rule
from minifaas.policy.short_term import ShortTermConfig
from minifaas.sim.arrivals import ArrivalKind, ArrivalSpec
from minifaas.sim.deployment import SimConfig, config_for
from minifaas.sim.fluid_link import LinkConfig
from minifaas.sim.report import SimResult
from minifaas.sim.simulator import Simulation
from minifaas.sim.workload import MAX_REQUEST_TOKENS, MAX_SPAN_S, Workload, read_workload, synthetic
from minifaas.traces import SHIPPED_TRACES

# dest -> default of the flags that only some runs read: synthetic arrivals, a trace, each scheduler
SYNTHETIC_FLAGS = {"arrivals": ArrivalKind.POISSON.value, "load": 0.8, "rate": None, "on_s": 10.0, "off_s": 10.0,
                   "off_fraction": 0.0, "seed": 0}  # fmt: skip
TRACE_FLAGS = {"length_scale": 1.0, "rate_scale": 1.0}
SHORT_TERM_FLAGS = {"fixed_threshold": False}
LONG_TERM_FLAGS = {"no_rebalance": False, "rebalance_period": 300.0, "convert_s": 60.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action", nargs="?", choices=("compare",),
        help="compare: simulate each --policy on the same deployment and workload, print a table and write a plot "
        "(default: simulate once)",
    )  # fmt: skip
    deploy = parser.add_argument_group("deployment")
    deploy.add_argument("--case", default="paper", help="a named case (paper) or a TOML/JSON case file")
    deploy.add_argument("--config", choices=("prfaas", "homogeneous", "naive"), default="prfaas", help="what to run")
    deploy.add_argument(
        "--gpus",
        type=arguments.positive_int,
        help="scale the case's instance counts and link to this many GPUs (default: the case's)",
    )
    deploy.add_argument("--n-prfaas", type=arguments.count, help="PrfaaS instances (default: the plan's)")
    deploy.add_argument("--n-prefill", type=arguments.count, help="PD-P instances (default: the plan's)")
    deploy.add_argument("--n-decode", type=arguments.count, help="PD-D instances (default: the plan's)")
    deploy.add_argument("--threshold", type=arguments.count, help="offload threshold in tokens (default: the plan's)")
    deploy.add_argument(
        "--spill-tokens", type=arguments.count, default=0, metavar="N",
        help="a short prompt goes to PrfaaS while PD-P's queue is N tokens longer and the link has room, as "
        "minifaas serve does by default; the link's use is read only with --scheduler (default: 0, the threshold rule "
        "alone)",
    )  # fmt: skip
    deploy.add_argument(
        "--max-link-backlog", type=arguments.non_negative, default=0.0, metavar="SECONDS",
        help="a long prompt stays on PD-P while the state routed across the link needs longer than this to cross, "
        "as minifaas serve does with 30 (default: 0, no bound)",
    )  # fmt: skip
    deploy.add_argument("--rule", choices=[r.value for r in Rule], default=Rule.SCARCE.value, help="routing rule")
    deploy.add_argument("--no-prefix-cache", action="store_true", help="no prefix cache in either cluster")
    deploy.add_argument("--cache-gb", type=arguments.positive, help="prefix pool size per cluster (default: unlimited)")
    arguments.add_kv_arguments(deploy)
    deploy.add_argument(
        "--prfaas-profile", help="a profile file (minifaas profile) for the PrfaaS instances (default: the case's)"
    )
    deploy.add_argument(
        "--pd-profile",
        help="a profile file for the PD instances, prefill and, if it has one, decode (default: the case's)",
    )
    sched = parser.add_argument_group("scheduler (off by default: the plan's t and split stay fixed)")
    sched.add_argument("--scheduler", action="store_true", help="adapt t every tick and re-plan N_p/N_d")
    policies = parser.add_argument_group("policies (docs/POLICIES.md)")
    arguments.add_policy_arguments(policies, "router", "where each request is prefilled and decoded", "default",
                                   "default")  # fmt: skip
    arguments.add_policy_arguments(policies, "short-term", "t and the routing rule each tick; turns the short-term "
                                   "scheduler on", "default", "default")  # fmt: skip
    arguments.add_policy_arguments(policies, "long-term", "the P:D split once a period; turns re-planning on",
                                   "default", "default")  # fmt: skip
    arguments.add_policy_arguments(policies, "snapshot-policy", "where the prefix pools keep state snapshots",
                                   "interval", "reuse, interval")  # fmt: skip
    sched.add_argument(
        "--fixed-threshold", action="store_true", default=None,
        help="with the short-term scheduler (--scheduler, --short-term): t and the rule stay fixed",
    )  # fmt: skip
    sched.add_argument(
        "--no-rebalance", action="store_true", default=None,
        help="with the long-term scheduler (--scheduler, --long-term): no re-planning, no re-roling",
    )  # fmt: skip
    sched.add_argument(
        "--rebalance-period", type=arguments.positive,
        help="with the long-term scheduler: seconds between re-plans (default: 300)",
    )  # fmt: skip
    sched.add_argument(
        "--convert-s", type=arguments.non_negative,
        help="with the long-term scheduler: restart time of a re-roled PD worker (default: 60)",
    )  # fmt: skip
    link = parser.add_argument_group("link")
    link.add_argument("--link-gbps", type=arguments.positive, help="inter-cluster bandwidth (default: the case's)")
    link.add_argument("--rtt-ms", type=arguments.non_negative, default=10.0, help="round-trip time of the link")
    link.add_argument(
        "--pipeline-layers", type=arguments.count, default=61, help="layers streamed during prefill; 0 = off"
    )
    link.add_argument(
        "--bandwidth-schedule",
        type=bandwidth_schedule,
        default="",
        help="changes as TIME_S:GBPS,..., e.g. 600:20,900:100 (default: none)",
    )
    arguments.add_policy_arguments(
        link, "kv-compression", "the codec of PrfaaS transfers, chosen by the live policy; auto: lossless where it "
        "saves time", "none", "none, lossless, auto",
    )  # fmt: skip
    link.add_argument(
        "--lossless",
        type=codec_figures,
        default="1.3,200,200",
        metavar="RATIO,ENC_GBPS,DEC_GBPS",
        help="the lossless codec's ratio and GB/s of state coded and decoded (default: 1.3,200,200, SplitZip's "
        "figures on a GPU)",
    )
    load = parser.add_argument_group("workload")
    load.add_argument(
        "--trace",
        type=arguments.trace,
        help=f"replay a trace instead of synthetic requests: {', '.join(SHIPPED_TRACES)} (shipped in data/traces), "
        f"or a Mooncake .jsonl / Azure .csv file; at most {MAX_REQUEST_TOKENS:,} tokens a request, prompt and "
        f"output, and {MAX_SPAN_S / 86_400:g} days of arrivals once scaled and cut (default: none)",
    )
    # the defaults of the flags below that only some runs read are in SYNTHETIC_FLAGS and TRACE_FLAGS
    load.add_argument(
        "--length-scale", type=arguments.positive, help="with --trace: its prompt lengths times this (default: 1)"
    )
    load.add_argument(
        "--rate-scale", type=arguments.positive, help="with --trace: its arrival rate times this (default: 1)"
    )
    load.add_argument(
        "--duration", type=arguments.positive, help="seconds of arrivals (default: 600; a trace: all of it)"
    )
    load.add_argument("--arrivals", choices=[k.value for k in ArrivalKind], help="arrival process (default: poisson)")
    load.add_argument(
        "--load", type=arguments.positive, help="offered rate as a fraction of planned capacity (default: 0.8)"
    )
    load.add_argument("--rate", type=arguments.positive, help="offered rate in req/s (default: from --load)")
    load.add_argument("--on-s", type=arguments.positive, help="bursty: mean ON period (default: 10)")
    load.add_argument("--off-s", type=arguments.positive, help="bursty: mean OFF period (default: 10)")
    load.add_argument("--off-fraction", type=arguments.fraction, help="bursty: OFF rate / ON rate (default: 0)")
    load.add_argument("--seed", type=int, help="seed of the synthetic workload (default: 0)")
    out = parser.add_argument_group("output")
    out.add_argument("--warmup", type=arguments.non_negative, default=0.0, help="seconds not counted in throughput")
    out.add_argument("--no-drain", action="store_true", help="stop at the last arrival")
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--queues-csv", type=arguments.output_file, metavar="CSV",
                     help="write the queue depths over time (default: none)")  # fmt: skip
    out.add_argument("--queues-png", type=arguments.figure_file, metavar="FILE",
                     help=f"plot the queue depths over time in {arguments.FIGURE_HELP} (needs matplotlib; "
                     "default: none)")  # fmt: skip
    out.add_argument("--no-progress", action="store_true", help="no progress bar on a long run")
    sim_compare.add_arguments(parser)


def bandwidth_schedule(text: str) -> tuple[tuple[float, float], ...]:
    """'600:20,900:100' -> ((600.0, 20.0), (900.0, 100.0)): from 600 s the link runs at 20 Gbit/s, and so on."""
    try:
        steps = tuple((float(t), float(g)) for t, g in (item.split(":") for item in text.split(",") if item))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not TIME_S:GBPS,...: {text!r} (e.g. 600:20,900:100)") from None
    if any(t < 0 or g < 0 for t, g in steps):
        raise argparse.ArgumentTypeError(f"times and rates must be >= 0: {text!r}")
    return steps


def codec_figures(text: str) -> CodecEstimate:
    """'1.3,200,200' -> ratio 1.3, coding and decoding 200 GB/s of state."""
    try:
        ratio, encode, decode = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not RATIO,ENCODE_GBPS,DECODE_GBPS: {text!r} (e.g. 1.3,200,200)") from None
    if ratio <= 0 or encode <= 0 or decode <= 0:
        raise argparse.ArgumentTypeError(f"ratio and speeds must be > 0: {text!r}")
    return CodecEstimate(ratio, encode * 1e9, decode * 1e9)


def scaled_counts(case: PlanCase, gpus: int) -> dict[str, int]:
    """The case's instance counts scaled to ``gpus`` GPUs, each rounded."""
    factor = gpus / case.gpus
    return {name: round(getattr(case, name) * factor) for name in ("n_prfaas", "n_pd", "n_homogeneous")}


def _too_few(counts: dict[str, int]) -> bool:
    return min(counts["n_pd"], counts["n_homogeneous"]) < 2


def scaled_case(case: PlanCase, gpus: int | None, link_gbps: float | None) -> PlanCase:
    """The case with its instance counts and link scaled to ``gpus`` GPUs; ValueError saying what the scaling came
    to, and the fewest GPUs that do, where it leaves fewer than two PD or homogeneous instances."""
    if gpus is None:
        return case.with_overrides(link_gbps=link_gbps)
    counts = scaled_counts(case, gpus)
    if _too_few(counts):
        enough = next(g for g in range(gpus + 1, case.gpus + 1) if not _too_few(scaled_counts(case, g)))
        raise ValueError(
            f"{case.name}: need n_pd >= 2 and n_homogeneous >= 2, and its {case.gpus} GPUs scaled to {gpus} leave "
            f"n_pd {counts['n_pd']} and n_homogeneous {counts['n_homogeneous']} ({enough} GPUs or more keep both)"
        )
    link = link_gbps if link_gbps is not None else case.link_gbps * gpus / case.gpus
    return case.with_overrides(**counts, link_gbps=link)


def with_profiles(case: PlanCase, prfaas: str | None, pd: str | None) -> PlanCase:
    """The case with measured instance profiles in place of its own."""
    return case.with_overrides(
        prfaas=load_prefill_profile(prfaas) if prfaas else None,
        pd_prefill=load_prefill_profile(pd) if pd else None,
        decode=load_profiles(pd)[1] if pd else None,
    )


def schedulers_on(args: argparse.Namespace) -> tuple[bool, bool]:
    """Whether the short-term and the long-term scheduler run: --scheduler, its own policy, or one compared."""
    compared = sim_compare.kinds(args)
    short = bool(args.scheduler or args.short_term or "short-term" in compared)
    return short, bool(args.scheduler or args.long_term or "long-term" in compared)


def checked_flags(args: argparse.Namespace) -> argparse.Namespace:
    """The flags with every default filled in; ValueError naming those given where they would change nothing:
    synthetic arrivals' with --trace, a trace's without one, a scheduler's while that scheduler is off."""
    short, long = schedulers_on(args)
    off = "scheduler, which is off"
    kinds = (  # the flags of each kind, whether they change nothing in this run, and why
        (SYNTHETIC_FLAGS, bool(args.trace), "for synthetic arrivals only: with --trace, the trace sets the arrivals"),
        (TRACE_FLAGS, not args.trace, "for a trace only: give --trace"),
        (SHORT_TERM_FLAGS, not short, f"for the short-term {off}: --scheduler or --short-term runs it"),
        (LONG_TERM_FLAGS, not long, f"for the long-term {off}: --scheduler or --long-term runs it"),
    )
    for flags, idle, why in kinds:
        given = ["--" + dest.replace("_", "-") for dest in flags if getattr(args, dest) is not None]
        if idle and given:
            raise ValueError(f"{', '.join(given)}: {why}")
    unset = {dest: value for flags, _, _ in kinds for dest, value in flags.items() if getattr(args, dest) is None}
    return argparse.Namespace(**{**vars(args), **unset})


def build(args: argparse.Namespace) -> tuple[SimConfig, Workload, OperatingPoint]:
    args = checked_flags(args)
    base = with_profiles(named_case(args.case), args.prfaas_profile, args.pd_profile)
    try:
        case = scaled_case(base, args.gpus, args.link_gbps)
    except ValueError as e:  # too few GPUs for the case's instances
        raise ValueError(f"--gpus {args.gpus}: {e}") from None
    case = case.with_kv(args.kv_bytes_per_token, args.kv_fixed_bytes)
    point: OperatingPoint = getattr(plan(case), args.config)
    link = LinkConfig(case.link_gbps, args.rtt_ms / 1000, args.pipeline_layers, args.bandwidth_schedule)
    config = config_for(
        case,
        point,
        link,
        rule=Rule(args.rule),
        prefix_cache=not args.no_prefix_cache,
        cache_bytes=args.cache_gb * 1e9 if args.cache_gb else float("inf"),
        warmup_s=args.warmup,
        drain=not args.no_drain,
        convert_s=args.convert_s,
        codecs=(("lossless", args.lossless),),
        **policies(args),
    )
    short, long = schedulers_on(args)
    if short:
        ceiling = int(case.lengths.values[-1])
        config = replace(config, short_term=ShortTermConfig(enabled=not args.fixed_threshold, ceiling=max(ceiling, 1)))
    if long:
        config = replace(
            config, long_term=LongTermConfig(enabled=not args.no_rebalance, period_s=args.rebalance_period)
        )
    overrides = {k: getattr(args, k) for k in ("n_prfaas", "n_prefill", "n_decode", "threshold")}
    config = replace(config, **{k: v for k, v in overrides.items() if v is not None})
    if args.spill_tokens or args.max_link_backlog:
        router = replace(config.router, spill_tokens=args.spill_tokens, max_link_backlog_s=args.max_link_backlog)
        config = replace(config, router=router)
    workload = workload_of(args, case, point)
    if workload.duration_s == 0:  # throughput counts over the span of the arrivals
        raise ValueError(f"{len(workload)} request(s), all arriving at once: no span of arrivals to count over "
                         "(a longer --duration, or a higher rate, gives one)")  # fmt: skip
    if args.warmup >= workload.duration_s:
        span = f"the {workload.duration_s:g} s of arrivals"
        raise ValueError(f"--warmup {args.warmup:g} s leaves nothing of {span} to count")
    return config, workload, point


def workload_of(args: argparse.Namespace, case: PlanCase, point: OperatingPoint) -> Workload:
    """The trace, scaled and cut to --duration, or synthetic arrivals at --rate (else --load of the plan's rate)."""
    if args.trace:
        workload = read_workload(args.trace, args.length_scale, args.rate_scale)
        if args.duration is not None:
            workload = workload.head(int((workload.arrival_s < args.duration).sum()))
        workload.check_bounds()
        return workload
    rate = args.rate if args.rate is not None else args.load * point.throughput_rps
    arrivals = ArrivalSpec(ArrivalKind(args.arrivals), rate, args.on_s, args.off_s, args.off_fraction)
    duration = 600.0 if args.duration is None else args.duration
    return synthetic(case.lengths, round(case.output_tokens), arrivals, duration, args.seed)


def policies(args: argparse.Namespace) -> dict[str, object]:
    """The SimConfig fields of the policies the flags name (each unnamed one stays the built-in)."""
    fields: dict[str, object] = {}
    for flag, (spec_field, args_field) in sim_compare.POLICY_FIELDS.items():
        attr = flag.replace("-", "_")
        if getattr(args, attr) is not None:
            fields[spec_field] = getattr(args, attr)
        fields[args_field] = getattr(args, f"{attr}_arg") or ()
    return fields


def simulate(simulation: Simulation, workload: Workload, show_progress: bool) -> SimResult:
    if not show_progress:
        return simulation.run()
    columns = (TextColumn("simulating"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} s"))
    with Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("sim", total=max(workload.duration_s, 1.0))
        result = simulation.run(progress=lambda now: progress.update(task, completed=min(now, workload.duration_s)))
    return result


def run(args: argparse.Namespace) -> int:
    with user_input():
        config, workload, point = build(args)
        configs = sim_compare.variants(config, args) if args.action == "compare" else {"": config}
        simulations = [Simulation(c, workload) for c in configs.values()]  # each policy built: its refusal is ours
    if args.action == "compare":
        return sim_compare.run(configs, workload, args)
    show = not args.no_progress and sys.stderr.isatty() and len(workload) > 20_000
    result = simulate(simulations[0], workload, show)
    if args.queues_csv:
        result.write_queues_csv(args.queues_csv)
    if args.queues_png:
        draw_or_say(args.queues_png, result.plot_queues)
    summary = {
        "workload": workload.name,
        "gpus": config.gpus,
        "config": point.config,
        "threshold_tokens": config.threshold,
        "n_prfaas": config.n_prfaas,
        "n_prefill": config.n_prefill,  # the split the run started with
        "n_decode": config.n_decode,
        "n_prefill_final": result.n_prefill_final,  # and the one it ended with, once the long-term scheduler re-roled
        "n_decode_final": result.n_decode_final,
        "planned_throughput_rps": point.throughput_rps,
        "scheduler": config.short_term is not None or config.long_term is not None,  # either of them ran
        **result.to_dict(),
    }
    stuck = result.requests - result.completed - result.rejected
    if config.drain and stuck:
        note = f"{stuck:,} requests never finished: no event was left to move them (a link cut for good?)"
        print(note, file=sys.stderr if args.json else sys.stdout)
    note = plan_note(config, point)
    if note:  # on stderr with --json, so that stdout stays one JSON object
        print(note, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(figures.dumps(summary, indent=2))
    else:
        for key, value in figures.rounded(summary).items():
            print(f"{key:>28}  {'-' if value is None else value}")
    return 0


def plan_note(config: SimConfig, point: OperatingPoint) -> str | None:
    """One line on a plan that leaves a path unused, and why, so that its empty figures are no surprise."""
    if point.config != "prfaas" or 0 < point.offload_fraction < 1:
        return None
    offloaded = point.offload_fraction == 1
    mean = point.l_long if offloaded else point.l_short
    pd_s, prfaas_s = float(config.pd_prefill.latency_s(mean)), float(config.prfaas.latency_s(mean))
    times = f"a {mean:,.0f}-token prefill takes {pd_s:.3g} s on a PD instance and {prfaas_s:.3g} s on PrfaaS"
    if offloaded:
        return (
            f"plan: PrfaaS prefills every prompt (t = {config.threshold:,}), {config.n_decode} PD instances decode "
            f"and {config.n_prefill} prefill: {times}, so the PD cluster is worth more decoding (bottleneck: "
            f"{point.bottleneck}); no request takes the PD prefill path, and its figures are empty"
        )
    return f"plan: no prompt is offloaded (t = {config.threshold:,}): {times}; PrfaaS stays idle"

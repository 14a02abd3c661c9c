"""``python -m ca_testkit``: the OpInfo sweep and the random-graph fuzzer.

python -m ca_testkit sweep --backend aot_eager [--impl ca|torch] [--ops PATTERN]
                           [--dtype float32,float64,complex64] [--samples K|all]
                           [--every N] [--timeout SECONDS] [--jobs N] --json out.json
python -m ca_testkit report a.json b.json [--markdown out.md]
python -m ca_testkit fuzz --examples 5000 [--backend none|eager|aot_eager] [--seed N] [--jobs N] [--combined]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _sweep(args: argparse.Namespace) -> int:
    import time

    if _missing_extra("expecttest", "sweep"):  # torch's OpInfo database imports it
        return 2
    from ca_testkit import sweep

    try:
        dtypes = sweep.parse_dtypes(args.dtype)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    tasks = sweep.select(args.ops, dtypes, args.every)
    if not tasks:
        print(f"no op matches --ops {args.ops!r} in {', '.join(dtypes)}", file=sys.stderr)
        return 2
    timeout = args.timeout if args.timeout > 0 else None
    start = time.perf_counter()
    results = sweep.run_sweep(
        tasks,
        args.backend,
        args.impl,
        jobs=args.jobs,
        max_samples=args.samples,
        timeout=timeout,
        progress=True,
    )
    elapsed = time.perf_counter() - start
    samples = "all" if args.samples is None else args.samples
    print(
        f"OpInfo sweep: impl={args.impl} backend={args.backend} dtypes={','.join(dtypes)} samples={samples} "
        f"every={args.every} timeout={timeout} jobs={args.jobs} ({elapsed:.0f} s)"
    )
    print(sweep.summary(results))
    if args.json:
        settings = {
            "dtypes": list(dtypes),
            "samples": samples,
            "every": args.every,
            "timeout": timeout,
            "ops_pattern": args.ops,
            "seconds": round(elapsed, 1),
        }
        sweep.write_json(args.json, sweep.to_json(results, args.backend, args.impl, **settings))
    return 0


def _samples(text: str) -> int | None:
    """``--samples``: a positive int, or ``all`` (None)."""
    if text == "all":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int or 'all', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int or 'all', got {text!r}")
    return value


def _report(args: argparse.Namespace) -> int:
    from ca_testkit import sweep

    reports = []
    for path in args.reports:
        with open(path) as f:
            reports.append(json.load(f))
    text = sweep.markdown_comparison(reports)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    print(text)
    return 0


def _missing_extra(module: str, extra: str) -> bool:
    """Says which extra to install when ``module`` is missing (instead of a raw ModuleNotFoundError)."""
    import importlib.util

    if importlib.util.find_spec(module) is not None:
        return False
    print(f"this command needs {module!r}: pip install 'ca-testkit[{extra}]'", file=sys.stderr)
    return True


def _fuzz(args: argparse.Namespace) -> int:
    import time

    if _missing_extra("hypothesis", "fuzz"):
        return 2
    from ca_testkit import fuzz

    start = time.perf_counter()
    if args.jobs <= 1:
        snippets = [fuzz.fuzz_slice(args.examples, args.backend, args.seed, args.impl, args.combined)]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # Worker k explores its own seed (seed + k) with an equal share of the examples.
        shares = [args.examples // args.jobs + (k < args.examples % args.jobs) for k in range(args.jobs)]
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [
                pool.submit(fuzz.fuzz_slice, n, args.backend, args.seed + k, args.impl, args.combined)
                for k, n in enumerate(shares)
            ]
            snippets = [f.result() for f in futures]
    elapsed = time.perf_counter() - start
    failing = [s for s in snippets if s is not None]
    if failing:
        print(f"MISMATCH after shrinking ({elapsed:.0f} s):\n{failing[0]}")
        return 1
    print(
        f"{args.examples} random programs{' (combined)' if args.combined else ''}, no mismatch "
        f"(impl={args.impl}, backend={args.backend}, "
        f"seed={args.seed}, jobs={args.jobs}, {elapsed:.0f} s wall)"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ca_testkit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("sweep", help="compare every OpInfo op's grads with eager")
    p.add_argument("--backend", default="aot_eager", help="torch.compile backend (default aot_eager)")
    p.add_argument("--impl", default="ca", choices=["ca", "torch"], help="compiled autograd to check")
    p.add_argument("--ops", default="*", help="fnmatch pattern(s) on op names, comma-separated (default all)")
    p.add_argument(
        "--dtype",
        default="float32",
        help="comma-separated dtypes, each swept on the ops supporting it (default float32)",
    )
    p.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--samples", type=_samples, default=2, help="sample inputs per op, or 'all' (default 2)")
    p.add_argument(
        "--every", type=int, default=1, help="only every N-th op of the sorted selection (default 1: all)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds per (op, dtype) before it is a timeout; 0 for none (default 300)",
    )
    p.add_argument("--json", help="write the results as JSON here")
    p.set_defaults(run=_sweep)

    p = sub.add_parser("report", help="markdown comparison of sweep JSON files")
    p.add_argument("reports", nargs="+")
    p.add_argument("--markdown", help="write the markdown here too")
    p.set_defaults(run=_report)

    p = sub.add_parser("fuzz", help="random autograd graphs, compared with eager")
    p.add_argument("--examples", type=int, default=500, help="graphs to try (default 500)")
    p.add_argument("--backend", default="none", help="none (graph as captured), or a torch.compile backend")
    p.add_argument(
        "--impl",
        default="ca",
        choices=["ca", "torch", "ca-background", "ca-capture-after-2"],
        help="ca-background: ours with Inductor compiling in the background (needs --backend inductor); "
        "ca-capture-after-2: enable()'s default, each variant run twice (deferred, then captured)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--jobs", type=int, default=1, help="worker processes, seeds seed..seed+jobs-1 (default 1)"
    )
    p.add_argument(
        "--combined",
        action="store_true",
        help="also saved-tensor hooks, setup_context/once_differentiable Functions and double backward",
    )
    p.set_defaults(run=_fuzz)

    args = parser.parse_args(argv)
    if getattr(args, "jobs", 1) < 1:
        parser.error("--jobs must be >= 1")
    if getattr(args, "every", 1) < 1:
        parser.error("--every must be >= 1")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

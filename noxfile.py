"""Sessions of the ca monorepo.

``nox -s tests`` and ``nox -s demo`` work on a fresh machine: each session
makes its own virtualenv, installs torch==2.13.0 (the CPU wheel pip finds on
disk), builds ca-core against it without build isolation, and installs
ca-runtime and ca-testkit. pip (nox's virtualenv backend) is used on purpose:
uv would download a multi-GB CUDA torch.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "virtualenv"
nox.options.sessions = ["tests"]

PACKAGES = ("packages/ca-core", "packages/ca-runtime", "packages/ca-testkit")
TEST_DIRS = tuple(f"{p}/tests" for p in PACKAGES)
BUILD_REQUIREMENTS = ("torch==2.13.0", "nanobind>=2.4", "scikit-build-core>=0.10", "cmake>=3.18", "ninja", "hatchling")


def _install(session: nox.Session, *extra: str) -> None:
    """torch and the build tools first, then the three packages without isolation."""
    session.install(*BUILD_REQUIREMENTS, *extra)
    session.install("--no-build-isolation", *PACKAGES)


def _run_tests(session: nox.Session, *paths: str, workers: str = "auto") -> None:
    """pytest over ``paths`` (every package's tests by default) with ``-n workers``."""
    args = session.posargs or [*(paths or TEST_DIRS), "-n", workers]
    session.run("pytest", *args)


TESTKIT_EXTRAS = ("expecttest", "hypothesis>=6")


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """Builds the three packages and runs every package's tests (pytest-xdist, -n auto)."""
    _install(session, "numpy", "pytest>=8", "pytest-xdist>=3", *TESTKIT_EXTRAS)
    _run_tests(session)


@nox.session(python="3.11", default=False)
def sweep(session: nox.Session) -> None:
    """OpInfo sweep for ours and torch's built-in compiled autograd; writes sweep/*.json and a markdown comparison.

    Extra arguments go to both sweeps (e.g. ``nox -s sweep -- --ops "a*" --samples 1``).
    """
    _install(session, "numpy", *TESTKIT_EXTRAS)
    session.run("mkdir", "-p", "sweep", external=True)
    for impl in ("ca", "torch"):
        session.run(
            "python", "-m", "ca_testkit", "sweep", "--backend", "aot_eager", "--impl", impl,
            "--jobs", "2", "--json", f"sweep/{impl}.json", *session.posargs,
        )
    session.run("python", "-m", "ca_testkit", "report", "sweep/ca.json", "sweep/torch.json",
                "--markdown", "sweep/comparison.md")


@nox.session(python="3.11", default=False)
def fuzz(session: nox.Session) -> None:
    """The random-graph fuzzer, long budget: 5,000 graphs (``nox -s fuzz -- --examples N`` to change)."""
    _install(session, "numpy", *TESTKIT_EXTRAS)
    session.run("python", "-m", "ca_testkit", "fuzz", "--examples", "5000", *session.posargs)


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """A few training steps of a small MLP under compiled autograd, compared with eager."""
    _install(session, "numpy")
    session.run("python", "examples/train_mlp.py", *session.posargs)


@nox.session(python="3.11", default=False)
def bench(session: nox.Session) -> None:
    """Eager vs torch's built-in vs our compiled autograd, 1 thread; writes bench/results/{results.json,results.md,overhead.png}.

    ``nox -s bench -- --quick`` uses aot_eager instead of inductor for the models.
    """
    _install(session, "numpy", "matplotlib")
    session.run("python", "bench/run.py", *session.posargs)

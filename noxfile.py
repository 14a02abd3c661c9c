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


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """Builds the three packages and runs every package's tests (pytest-xdist, -n auto)."""
    _install(session, "numpy", "pytest>=8", "pytest-xdist>=3")
    _run_tests(session)


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """A few training steps of a small MLP under compiled autograd, compared with eager."""
    _install(session, "numpy")
    session.run("python", "examples/train_mlp.py", *session.posargs)

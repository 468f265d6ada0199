"""The built package, as a user gets it: a wheel (and sdist) built offline from the sources, installed into a
fresh virtual environment, imported and launched from outside the repository."""

import ast
import importlib.metadata
import os
import re
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Building with --no-build-isolation uses this environment's setuptools; the PEP 639 license fields of
# pyproject.toml (license = "Apache-2.0", license-files) need setuptools 77.
SETUPTOOLS_MIN = (77,)


def _version_file() -> str:
    tree = ast.parse((ROOT / "spmdcomm" / "_version.py").read_text())
    (value,) = [
        node.value.value for node in tree.body if isinstance(node, ast.Assign) and node.targets[0].id == "__version__"
    ]
    return value


def _setuptools_version() -> tuple[int, ...]:
    try:
        text = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return ()
    return tuple(int(p) for p in re.findall(r"\d+", text)[:2])


def _run(cmd, *, timeout, **kwargs):
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs)
    assert out.returncode == 0, f"{cmd} exited {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out


JOB = """\
import numpy as np

import spmdcomm as sc

sc.initialize(timeout=60)
rank = sc.process_index()
total = sc.host_all_reduce(np.array([rank + 1.0]))                     # host side, across processes
f = sc.spmd(lambda b: sc.psum(b, "data"), in_specs=sc.P("data"), out_specs=sc.P())
mine = np.arange(2.0 * sc.local_device_count()).reshape(-1, 2) + 2.0 * sc.local_device_count() * rank
rows = np.asarray(f(mine))  # on devices: each process passes its own rows (host input is process-local)
sc.barrier("done")
print("JOB OK", rank, sc.process_count(), float(total[0]), rows.tolist(), sc.__file__)
"""


@pytest.mark.slow
@pytest.mark.skipif(
    _setuptools_version() < SETUPTOOLS_MIN,
    reason="building offline needs setuptools>=77 here: pip install 'setuptools>=77'",
)
def test_wheel_installs_imports_and_launches_outside_the_repo(tmp_path):
    version = _version_file()
    # Build from a copy holding only what the build reads, so the checkout gets no build/ or *.egg-info
    # and stray files in it cannot leak into the wheel.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "spmdcomm", src / "spmdcomm", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--disable-pip-version-check",
            "-q",
            "-w",
            dist,
            src,
        ],
        timeout=180,
    )
    _run(
        [sys.executable, "-c", "import sys; from setuptools import build_meta as b; b.build_sdist(sys.argv[1])", dist],
        timeout=180,
        cwd=src,
    )

    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    (wheel,) = dist.glob("spmdcomm-*.whl")
    assert wheel.name == f"spmdcomm-{version}-py3-none-any.whl"
    info = f"spmdcomm-{version}.dist-info"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        assert zf.read(f"{info}/licenses/LICENSE").decode() == license_text
        metadata = zf.read(f"{info}/METADATA").decode()
        assert "spmdcomm-launch = spmdcomm.launch:main" in zf.read(f"{info}/entry_points.txt").decode()
    assert f"\nVersion: {version}\n" in metadata and "\nLicense-Expression: Apache-2.0\n" in metadata
    # __init__.pyi: the list of public names, which the type checker and the lazy loader in __init__.py read
    assert {"spmdcomm/__init__.py", "spmdcomm/__init__.pyi", "spmdcomm/_version.py", "spmdcomm/py.typed"} <= names
    assert not any(n.startswith(("tests/", "docs/", "examples/", "benchmarks/")) for n in names)
    (sdist,) = dist.glob("spmdcomm-*.tar.gz")
    with tarfile.open(sdist) as tf:
        assert tf.extractfile(f"spmdcomm-{version}/LICENSE").read().decode() == license_text

    venv = tmp_path / "v"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], timeout=120)
    python, launcher = venv / "bin" / "python", venv / "bin" / "spmdcomm-launch"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            python,
            "install",
            "--no-deps",
            "--no-index",
            "--disable-pip-version-check",
            "-q",
            wheel,
        ],
        timeout=180,
    )
    # The dependencies (jax, flax, ...) come from this environment. A .pth file appends its directories
    # after the new environment's own site-packages, so the installed wheel is found first (PYTHONPATH
    # would put them in front, where a non-editable spmdcomm there would shadow the wheel). Directories
    # named in a .pth file get no .pth processing of their own, so an editable install there stays off.
    purelib = _run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], timeout=60
    ).stdout.strip()
    deps = [p for p in site.getsitepackages() if Path(p).resolve() != ROOT]
    Path(purelib, "_deps_for_test.pth").write_text("\n".join(deps) + "\n")

    run_dir = tmp_path / "run"  # not the repository, so nothing imports from the checkout
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS", "PYTHONHOME")}
    env.update(JAX_PLATFORMS="cpu", PYTHONNOUSERSITE="1")
    probe = (
        "import importlib.metadata as m, sys, spmdcomm; "
        "print(spmdcomm.__version__, m.version('spmdcomm'), spmdcomm.__file__); "
        "print(*sys.path, sep='\\n', file=sys.stderr)"
    )
    out = _run([python, "-c", probe], timeout=120, cwd=run_dir, env=env)
    got_version, dist_version, where = out.stdout.split()
    assert (got_version, dist_version) == (version, version), out.stdout
    assert Path(where).resolve().is_relative_to(venv.resolve()), out.stdout
    assert str(ROOT) not in out.stderr.split("\n"), out.stderr

    (run_dir / "job.py").write_text(JOB)
    out = _run(
        [launcher, "-n", "2", "--devices-per-process", "1", "--timeout", "120", "--grace", "2", "job.py"],
        timeout=150,
        cwd=run_dir,
        env=env,
    )
    done = sorted(re.findall(r"^\[rank (\d)\] JOB OK (\d) 2 3\.0 \[\[2\.0, 4\.0\]\] (\S+)$", out.stdout, re.M))
    assert [(r, r2) for r, r2, _ in done] == [("0", "0"), ("1", "1")], out.stdout + out.stderr
    assert all(Path(f).resolve().is_relative_to(venv.resolve()) for _, _, f in done), out.stdout

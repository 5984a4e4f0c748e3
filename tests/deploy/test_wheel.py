"""The package as users install it (issue 16): a wheel built from the repository, installed
non-editable into a fresh virtual environment, runs its CPU kernels from the files the wheel
ships and answers ``cb-serve generate`` on the built-in model, never falling back to the
PyTorch path.

The fresh environment reuses this environment's third-party packages (torch, transformers,
the model package) through a plain path in a ``.pth`` file, so nothing is downloaded; the
editable install of this checkout is not visible there (its finder is registered by a ``.pth``
file of this environment, which a plain path entry does not process). A kernel build is keyed by
the bytes of its sources and every header beside them (``cpu_ops.build_directory``): the wheel's
kernel files are checked byte for byte against the repository's, so the build the wheel's
process finds (or makes) under that key is the one its files make. (It once built into an empty
directory: a full kernel build, about 80 s of one core, for the same result.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "cb_serve" / "cpu_ops" / "csrc"
FALLBACK = "using the PyTorch path"


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{cmd} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: setuptools comes from this environment (no index needed).
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)])
    (path,) = out.glob("cb_serve-*.whl")
    return path


def test_the_wheel_ships_every_file_the_kernels_and_pages_need(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = [p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h")]
    assert any(p.suffix == ".h" for p in needed)
    missing = [p.name for p in needed if f"cb_serve/cpu_ops/csrc/{p.name}" not in names]
    assert not missing, f"the wheel lacks kernel sources: {missing}"
    assert "cb_serve/serve/static/inspect.html" in names
    # Every header a kernel includes is one the wheel ships (the bug: vec_math.h was left out).
    for source in CSRC.glob("*.cpp"):
        for line in source.read_text().splitlines():
            if line.startswith('#include "'):
                header = line.split('"')[1]
                assert f"cb_serve/cpu_ops/csrc/{header}" in names, f"{source.name} includes {header}"


def test_the_wheel_ships_no_test_data(wheel):
    """Test and benchmark data (the JSON schema suite: ``tests/json_schemas.py``) stays in the repository."""
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if "json_schemas" in n or n.startswith(("tests/", "bench/"))]
    assert max(zipfile.ZipFile(wheel).getinfo(n).file_size for n in names if n.endswith(".py")) < 40_000


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
def test_a_non_editable_install_runs_the_kernels_of_its_files_and_generates(wheel, tmp_path):
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)])  # pip from ensurepip: offline
    python = venv / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)])

    shipped = site / "cb_serve" / "cpu_ops" / "csrc"
    assert {p.name: p.read_bytes() for p in shipped.iterdir() if p.suffix in (".cpp", ".h")} == {
        p.name: p.read_bytes() for p in CSRC.iterdir() if p.suffix in (".cpp", ".h")
    }, "the wheel's kernel files differ from the repository's"
    env = dict(os.environ, CB_SERVE_CPU_OPS="1")
    env.pop("PYTHONPATH", None)
    where = run([str(python), "-c", "import cb_serve; print(cb_serve.__file__)"], env=env, cwd=tmp_path).stdout
    assert Path(where.strip()).is_relative_to(venv), f"cb_serve imported from {where} instead of the wheel"

    result = run(
        [str(venv / "bin" / "cb-serve"), "generate", "--json", "--prompt", "The capital of France is"]
        + ["--max-tokens", "8", "--max-model-len", "256"],
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert FALLBACK not in result.stderr, result.stderr
    (line,) = result.stdout.splitlines()
    completion = json.loads(line)
    assert len(completion["token_ids"]) == 8 and completion["text"].strip()

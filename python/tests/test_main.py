"""`python -m smoe`: versions, the library, how it was built, the device and
the backend and kernel path each kind of tensor gets; exit status 1 without
a library."""
import os
import subprocess
import sys

import torch

import smoe


def run_main(**env):
    # The smoe this test imported (installed, or the source tree conftest.py
    # put on sys.path).
    here = os.path.dirname(os.path.dirname(os.path.abspath(smoe.__file__)))
    e = dict(os.environ, **env)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (here, e.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "smoe"], env=e, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, universal_newlines=True,
                          cwd=os.path.dirname(os.path.abspath(__file__)))


def test_python_m_smoe():
    r = run_main()
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    v = smoe.library_version()
    assert lines[0] == "smoe %s (library %s)" % (v, v)
    assert lines[1] == "library: %s" % smoe.library_path()
    assert lines[2].startswith("built with: ")
    assert lines[3].startswith("torch: %s" % torch.__version__)
    if torch.cuda.is_available():
        assert lines[4].startswith("device: cuda:")
        assert any(l.startswith("CUDA bfloat16 tensors: backend ") for l in lines)
    else:
        assert lines[4].startswith("device: no CUDA device")
    assert "CPU float32 tensors: backend cpu, path cpu (f32" in r.stdout


def test_python_m_smoe_without_library(tmp_path):
    r = run_main(SMOE_LIBRARY=str(tmp_path / "missing.so"))
    assert r.returncode == 1 and "libsmoe.so not found" in r.stderr

"""The package build (pyproject.toml at the repository root, the backend in
python/build_backend/smoe_build.py) and `python -m smoe`.

The builds run CPU-only (SMOE_CUDA=0, seconds) in a copy of the sources in
a temporary folder: a wheel through pip offline (--no-index, pip's isolated
build environment empty), the library rebuilt after a source change and
never taken stale, an sdist that builds, and the configurations in their own
folders. `python -m smoe`: test_main.py."""
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

import smoe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BACKEND = os.path.join(ROOT, "python", "build_backend", "smoe_build.py")
pytestmark = pytest.mark.skipif(
    not os.path.exists(BACKEND) or not os.path.exists(os.path.join(ROOT, "Makefile")),
    reason="not in a source checkout")
needs_make = pytest.mark.skipif(shutil.which("make") is None or shutil.which("cc") is None,
                                reason="needs make and cc")


def load_backend(root):
    spec = importlib.util.spec_from_file_location(
        "smoe_build_%d" % abs(hash(root)), os.path.join(root, "python", "build_backend",
                                                        "smoe_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def header_version(root=ROOT):
    text = open(os.path.join(root, "include", "smoe.h")).read()
    return ".".join(text.split("#define SMOE_VERSION_%s " % p)[1].split()[0]
                    for p in ("MAJOR", "MINOR", "PATCH"))


def library_version(path):
    """smoe_version_string() of a libsmoe.so, loaded in a fresh process."""
    code = ("import ctypes, sys; l = ctypes.CDLL(sys.argv[1]); "
            "l.smoe_version_string.restype = ctypes.c_char_p; "
            "print(l.smoe_version_string().decode())")
    return subprocess.check_output([sys.executable, "-c", code, path]).decode().strip()


@pytest.fixture
def tree(tmp_path):
    """The sources a build needs, copied."""
    root = tmp_path / "src"
    for name in ("Makefile", "README.md", "pyproject.toml", "python/README.md"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.join(ROOT, name), root / name)
    for name in ("include", "src", "python/smoe", "python/build_backend"):
        shutil.copytree(os.path.join(ROOT, name), root / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.o"))
    return str(root)


def cpu_env(**extra):
    env = dict(os.environ, SMOE_CUDA="0", SMOE_BUILD_PROGRESS="0", **extra)
    env.pop("SMOE_LIBRARY", None)
    env.pop("MAKEFLAGS", None)
    return env


def test_versions_agree():
    # smoe.h is the one source; the package and the ctypes mirror follow it.
    v = header_version()
    assert load_backend(ROOT)._version() == v
    assert smoe.__version__ == v
    assert ".".join(map(str, smoe._lib.VERSION)) == v


def test_toml_reader_without_tomllib(monkeypatch):
    # Python < 3.11 has no tomllib: the backend's own reader of
    # pyproject.toml's subset must read the same.
    backend = load_backend(ROOT)
    path = os.path.join(ROOT, "pyproject.toml")
    tomllib = pytest.importorskip("tomllib")
    want = tomllib.load(open(path, "rb"))
    monkeypatch.setitem(sys.modules, "tomllib", None)   # import tomllib raises ImportError
    assert backend._read_toml(path) == want


@needs_make
def test_pip_wheel_offline(tree, tmp_path):
    out = tmp_path / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index",
                        "--disable-pip-version-check", "-w", str(out), tree],
                       env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert r.returncode == 0, r.stdout.decode()[-3000:]
    wheels = os.listdir(out)
    v = header_version()
    assert len(wheels) == 1 and wheels[0].startswith("smoe-%s-py3-none-" % v), wheels
    with zipfile.ZipFile(out / wheels[0]) as z:
        names = set(z.namelist())
        modules = {"smoe/%s" % f for f in os.listdir(os.path.join(ROOT, "python", "smoe"))
                   if f.endswith(".py")}
        info = "smoe-%s.dist-info/" % v
        assert modules | {"smoe/libsmoe.so", info + "METADATA", info + "WHEEL",
                          info + "RECORD"} <= names
        meta = z.read(info + "METADATA").decode()
        assert "Version: %s\n" % v in meta and "Requires-Dist: torch>=2.4\n" in meta
        assert "Root-Is-Purelib: false" in z.read(info + "WHEEL").decode()
        # RECORD lists every other file with its sha256 and size.
        import base64
        import hashlib
        rows = [r.split(",") for r in z.read(info + "RECORD").decode().split()]
        assert {r[0] for r in rows} == names
        for name, digest, size in rows:
            if name == info + "RECORD":
                continue
            data = z.read(name)
            want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == "sha256=" + want and int(size) == len(data), name
        z.extract("smoe/libsmoe.so", str(tmp_path))
    assert library_version(str(tmp_path / "smoe" / "libsmoe.so")) == v
    # The CPU configuration's own folder.
    assert os.path.exists(os.path.join(tree, "build", "python-cpu", "libsmoe.so"))
    assert not os.path.exists(os.path.join(tree, "build", "python-cuda"))


@needs_make
def test_library_rebuilt_never_stale(tree, monkeypatch, capsys):
    monkeypatch.setenv("SMOE_CUDA", "0")
    monkeypatch.setenv("SMOE_BUILD_PROGRESS", "0")
    for name in ("SMOE_LIBRARY", "MAKEFLAGS"):
        monkeypatch.delenv(name, raising=False)
    backend = load_backend(tree)
    lib = backend.build_library("build/python-{config}")
    assert lib == os.path.join(tree, "build", "python-cpu", "libsmoe.so")
    first = capsys.readouterr().out
    assert "CPU only (SMOE_CUDA=0)" in first and "cc src/smoe.c" in first
    # Nothing changed: no compile, only the relink.
    backend.build_library("build/python-{config}")
    again = capsys.readouterr().out
    assert "(1 of 1 steps were needed" in again and "cc src/" not in again
    # A library put there by something else (an old build): replaced.
    with open(lib, "w") as f:
        f.write("not a library")
    backend.build_library("build/python-{config}")
    assert library_version(lib) == header_version(tree)
    # A changed header (e.g. after git pull): every object rebuilt, and the
    # library says so.
    h = os.path.join(tree, "include", "smoe.h")
    text = open(h).read()
    patch = text.split("#define SMOE_VERSION_PATCH ")[1].split()[0]
    with open(h, "w") as f:
        f.write(text.replace("#define SMOE_VERSION_PATCH %s" % patch,
                             "#define SMOE_VERSION_PATCH 77"))
    capsys.readouterr()
    backend.build_library("build/python-{config}")
    log = capsys.readouterr().out
    assert "cc src/smoe.c" in log and "cc src/cpu/cpu_backend.c" in log
    assert library_version(lib).endswith(".77")


def test_configuration_choice(monkeypatch, tmp_path):
    backend = load_backend(ROOT)
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("NVCC", str(nvcc))
    monkeypatch.delenv("SMOE_CUDA", raising=False)
    assert backend._configuration(None) == (True, str(nvcc), "CUDA, with %s" % nvcc)
    monkeypatch.setenv("SMOE_CUDA", "0")
    assert backend._configuration(None)[0] is False
    assert backend._configuration({"cuda": "1"})[0] is True   # -C cuda=1 over the environment
    monkeypatch.setenv("SMOE_CUDA", "2")
    with pytest.raises(RuntimeError, match="SMOE_CUDA='2', must be 0"):
        backend._configuration(None)
    monkeypatch.setenv("SMOE_CUDA", "1")
    monkeypatch.setenv("NVCC", "/nonexistent/nvcc")
    with pytest.raises(RuntimeError, match="SMOE_CUDA=1 but no nvcc found"):
        backend._configuration(None)
    monkeypatch.delenv("SMOE_CUDA")
    cuda, _, words = backend._configuration(None)       # no nvcc: CPU only, no error
    assert cuda is False and "no nvcc" in words


@needs_make
def test_sdist_builds(tree, tmp_path):
    backend = load_backend(tree)
    name = backend.build_sdist(str(tmp_path))
    base = "smoe-%s" % header_version()
    assert name == base + ".tar.gz"
    with tarfile.open(str(tmp_path / name)) as tar:
        names = set(tar.getnames())
        for want in ("PKG-INFO", "pyproject.toml", "Makefile", "include/smoe.h", "src/smoe.c",
                     "python/smoe/__init__.py", "python/build_backend/smoe_build.py"):
            assert base + "/" + want in names, want
        assert not any("/build/" in n or n.endswith((".o", ".so")) for n in names)
    out = tmp_path / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index",
                        "--disable-pip-version-check", "-w", str(out), str(tmp_path / name)],
                       env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert r.returncode == 0, r.stdout.decode()[-3000:]
    with zipfile.ZipFile(out / os.listdir(out)[0]) as z:
        assert "smoe/libsmoe.so" in z.namelist()

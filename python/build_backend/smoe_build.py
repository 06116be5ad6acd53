"""The smoe package's build backend (PEP 517 and PEP 660), standard library
only, named by pyproject.toml at the repository root.

`pip install .` needs nothing downloaded: pyproject.toml's build-system
requires no package, so pip's isolated build environment is empty and an
offline machine (or --no-build-isolation, or --no-index) builds the same.

What a wheel build does:
  1. picks the configuration: CUDA when $SMOE_CUDA is 1, or unset and an
     nvcc is found (on PATH, else $CUDA_HOME/bin, else /usr/local/cuda/bin);
     CPU-only when $SMOE_CUDA=0 or no nvcc (a build of seconds);
  2. runs `make` for build/python-cuda/libsmoe.so or build/python-cpu/
     libsmoe.so, one directory per configuration, with a job per CPU core
     ($SMOE_BUILD_JOBS, or a -j in $MAKEFLAGS, overrides). make's dependency
     rules (and the Makefile's stamp of the compiler flags) rebuild every
     object older than its sources, and the library is always relinked from
     the current object list, so the wheel never ships an old build, nor one
     of the other configuration;
  3. zips python/smoe/*.py and that libsmoe.so as smoe/libsmoe.so.
$SMOE_LIBRARY (a path to a libsmoe.so) skips 1 and 2 and ships that file.

Progress. pip shows a build backend's output only with `pip install -v`
(or when the build fails). So the progress lines (each compile step as it
starts, then the total time and the slowest files) also go straight to the
terminal, /dev/tty, when there is one; $SMOE_BUILD_PROGRESS=0 turns that
off. The full compiler output goes to pip's log either way.

An editable install (`pip install -e .`) builds build/libsmoe.so, the
library a source checkout loads, and adds python/ to sys.path: after a
change to the C code run `make lib` (or reinstall).
"""
import base64
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = "smoe"

# What an sdist holds: enough to build the library and the package.
_SDIST_FILES = ("pyproject.toml", "Makefile", "README.md", "python/README.md")
_SDIST_TREES = ("include", "src", "python/smoe", "python/build_backend")


# ------------------------------------------------------------ metadata

def _toml_value(text):
    """A TOML string or array of strings (the subset pyproject.toml uses)."""
    text = text.strip()
    if text.startswith("["):
        return re.findall(r'"((?:[^"\\]|\\.)*)"', text)
    if text.startswith('"'):
        return text[1:-1]
    if text in ("true", "false"):
        return text == "true"
    raise ValueError("pyproject.toml: cannot read the value %r (smoe_build reads strings, "
                     "arrays of strings and booleans without tomllib)" % text)


def _read_toml(path):
    """tomllib where Python has it (3.11+); otherwise a reader of the subset
    pyproject.toml is written in: [tables], key = "string", key = [arrays of
    strings, over several lines], true/false, whole-line comments."""
    try:
        import tomllib
    except ImportError:
        tomllib = None
    if tomllib is not None:
        with open(path, "rb") as f:
            return tomllib.load(f)
    data, table, key, pending = {}, None, None, None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if pending is not None:
                pending += " " + line
                if line.endswith("]"):
                    table[key] = _toml_value(pending)
                    pending = None
                continue
            m = re.match(r"^\[([\w.-]+)\]$", line)
            if m:
                table = data
                for part in m.group(1).split("."):
                    table = table.setdefault(part, {})
                continue
            key, _, value = line.partition("=")
            key, value = key.strip().strip('"'), value.strip()
            if value.startswith("[") and not value.endswith("]"):
                pending = value
                continue
            table[key] = _toml_value(value)
    return data


def _version():
    """The library's version, from include/smoe.h's macros (the one place it
    is written; the package's version is the library's)."""
    with open(os.path.join(ROOT, "include", "smoe.h")) as f:
        text = f.read()
    parts = [re.search(r"#define SMOE_VERSION_%s (\d+)" % p, text).group(1)
             for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(parts)


def _metadata():
    """The METADATA (PKG-INFO) file, from pyproject.toml's [project]."""
    project = _read_toml(os.path.join(ROOT, "pyproject.toml"))["project"]
    lines = ["Metadata-Version: 2.1", "Name: %s" % project["name"], "Version: %s" % _version(),
             "Summary: %s" % project["description"]]
    if "requires-python" in project:
        lines.append("Requires-Python: %s" % project["requires-python"])
    for dep in project.get("dependencies", []):
        lines.append("Requires-Dist: %s" % dep)
    for extra, deps in project.get("optional-dependencies", {}).items():
        lines.append("Provides-Extra: %s" % extra)
        for dep in deps:
            lines.append('Requires-Dist: %s; extra == "%s"' % (dep, extra))
    for label, url in project.get("urls", {}).items():
        lines.append("Project-URL: %s, %s" % (label, url))
    readme = project.get("readme")
    body = ""
    if readme:
        lines.append("Description-Content-Type: text/markdown")
        with open(os.path.join(ROOT, readme)) as f:
            body = f.read()
    return "\n".join(lines) + "\n\n" + body


def _dist_info():
    return "%s-%s.dist-info" % (NAME, _version())


def _tag():
    """py3-none-<platform>: pure Python over a shared library (no CPython
    extension), so any Python 3 on this platform."""
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return "py3-none-" + platform


# ------------------------------------------------------------ progress

class _Progress:
    """Progress lines to the terminal (/dev/tty) when there is one, since pip
    hides the backend's output; everything to stdout (pip's log)."""

    def __init__(self):
        self.tty = None
        if os.environ.get("SMOE_BUILD_PROGRESS", "1") != "0":
            try:
                self.tty = open("/dev/tty", "w")
            except OSError:
                self.tty = None
        self.start = time.monotonic()

    def say(self, message):
        line = "smoe: %s" % message
        print(line, flush=True)
        if self.tty is not None:
            try:
                # \r and erase-line: start clean after pip's spinner.
                self.tty.write("\r\x1b[K" + line + "\n")
                self.tty.flush()
            except OSError:
                self.tty = None

    def log(self, line):
        print(line, end="" if line.endswith("\n") else "\n", flush=True)

    def elapsed(self):
        return time.monotonic() - self.start

    def close(self):
        if self.tty is not None:
            self.tty.close()
            self.tty = None


# ------------------------------------------------------------ the library

def _find_nvcc():
    """nvcc as the Makefile would take it ($NVCC, then PATH), else in
    $CUDA_HOME/bin or /usr/local/cuda/bin (often not on PATH)."""
    if os.environ.get("NVCC"):
        return shutil.which(os.environ["NVCC"])
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return None


def _setting(config_settings, key, env):
    """A --config-settings value (-C key=value) or else the environment's."""
    if config_settings and key in config_settings:
        return str(config_settings[key])
    return os.environ.get(env)


def _configuration(config_settings):
    """(cuda: bool, nvcc path or None, words for the progress line)."""
    want = _setting(config_settings, "cuda", "SMOE_CUDA")
    if want is not None and want.strip() not in ("0", "1"):
        raise RuntimeError("smoe: SMOE_CUDA=%r, must be 0 (CPU only) or 1 (CUDA)" % want)
    if want is not None and want.strip() == "0":
        return False, None, "CPU only (SMOE_CUDA=0)"
    nvcc = _find_nvcc()
    if nvcc is None:
        if want is not None:
            raise RuntimeError("smoe: SMOE_CUDA=1 but no nvcc found ($NVCC, PATH, $CUDA_HOME/bin,"
                               " /usr/local/cuda/bin)")
        return False, None, "CPU only (no nvcc on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin)"
    return True, nvcc, "CUDA, with %s" % nvcc


def _jobs(config_settings):
    jobs = _setting(config_settings, "jobs", "SMOE_BUILD_JOBS")
    if jobs:
        return int(jobs)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def _make_command(build, cuda, nvcc, jobs, target):
    cmd = ["make", "-C", ROOT, "BUILD=" + build, "SMOE_CUDA=%d" % int(cuda)]
    if nvcc:
        cmd.append("NVCC=" + nvcc)
    if not re.search(r"(^|\s)-j|--jobs", os.environ.get("MAKEFLAGS", "")):
        cmd.append("-j%d" % jobs)
    return cmd + [target]


_STEP = re.compile(r"\s-o\s+(\S+)")


def _step_name(line):
    """'nvcc src/cuda/routing.cu' for a compile line, 'link libsmoe.so' for
    the link, from a command make echoes."""
    words = line.split()
    if not words:
        return None
    tool = os.path.basename(words[0])
    sources = [w for w in words if w.endswith((".c", ".cu"))]
    if " -c " in line and sources:
        return "%s %s" % ("nvcc" if "nvcc" in tool else "cc", sources[0])
    if " -shared " in line or line.startswith("ar "):
        m = _STEP.search(line)
        return "link %s" % os.path.basename(m.group(1)) if m else None
    return None


def build_library(build_dir, config_settings=None, progress=None):
    """Runs make for <build_dir>/libsmoe.so (build_dir relative to the
    repository root) and returns its path. The library is removed first, so
    make relinks it from the objects of the current sources (each rebuilt if
    older than what it depends on)."""
    own = progress is None
    progress = progress or _Progress()
    try:
        cuda, nvcc, words = _configuration(config_settings)
        build = build_dir.format(config="cuda" if cuda else "cpu")
        target = build + "/libsmoe.so"
        lib = os.path.join(ROOT, target)
        if shutil.which("make") is None:
            raise RuntimeError("smoe: building libsmoe.so needs make and a C compiler (and nvcc "
                               "for the CUDA backends); or set SMOE_LIBRARY to a built "
                               "libsmoe.so")
        jobs = _jobs(config_settings)
        cmd = _make_command(build, cuda, nvcc, jobs, target)
        if os.path.exists(lib):
            os.remove(lib)
        # A dry run counts the steps, for "[i/n]".
        dry = subprocess.run(cmd + ["-n"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             universal_newlines=True)
        total = sum(1 for line in dry.stdout.splitlines() if _step_name(line))
        progress.say("building %s: %s, %d jobs, %d steps (%s)"
                     % (target, words, jobs, total, " ".join(cmd)))
        started = {}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                universal_newlines=True, bufsize=1)
        for line in proc.stdout:
            progress.log(line)
            step = _step_name(line)
            if step:
                m = _STEP.search(line)
                if m:
                    started[m.group(1)] = (step, time.monotonic())
                progress.say("[%*d/%d] %s (%.0f s)" % (len(str(total)), len(started), total,
                                                       step, progress.elapsed()))
        if proc.wait() != 0:
            progress.say("make failed (exit status %d); the compiler's messages are above "
                         "(pip install -v shows them all)" % proc.returncode)
            raise RuntimeError("smoe: `%s` failed with exit status %d"
                               % (" ".join(cmd), proc.returncode))
        # Each step's time: its output's modification time less its start.
        times = []
        for out, (step, t0) in started.items():
            path = out if os.path.isabs(out) else os.path.join(ROOT, out)
            if os.path.exists(path) and not step.startswith("link"):
                done = os.path.getmtime(path) - (time.time() - time.monotonic())
                times.append((done - t0, step))
        times.sort(reverse=True)
        slowest = ", ".join("%s %.0f s" % (s, t) for t, s in times[:3])
        progress.say("built %s in %.0f s (%d of %d steps were needed%s)"
                     % (target, progress.elapsed(), len(started), total,
                        "; slowest: " + slowest if slowest else ""))
        return lib
    finally:
        if own:
            progress.close()


def _library(config_settings, progress):
    path = os.environ.get("SMOE_LIBRARY")
    if path:
        if not os.path.isfile(path):
            raise RuntimeError("smoe: SMOE_LIBRARY=%s is not a file" % path)
        progress.say("packaging SMOE_LIBRARY=%s (not building)" % path)
        return path
    return build_library("build/python-{config}", config_settings, progress)


# ------------------------------------------------------------ wheels

class _Wheel:
    """A wheel being written: files added with their RECORD lines."""

    def __init__(self, path):
        self.zip = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED)
        self.record = []

    def add(self, name, data, mode=0o644):
        if isinstance(data, str):
            data = data.encode()
        info = zipfile.ZipInfo(name, date_time=time.localtime(time.time())[:6])
        info.compress_type = zipfile.ZIP_DEFLATED
        info.external_attr = (0o100000 | mode) << 16
        self.zip.writestr(info, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        self.record.append("%s,sha256=%s,%d" % (name, digest, len(data)))

    def add_file(self, name, path):
        with open(path, "rb") as f:
            data = f.read()
        self.add(name, data, 0o755 if os.access(path, os.X_OK) else 0o644)

    def finish(self, metadata_files):
        info = _dist_info()
        for name, text in metadata_files.items():
            self.add(info + "/" + name, text)
        name = info + "/RECORD"
        self.record.append(name + ",,")
        self.zip.writestr(zipfile.ZipInfo(name, date_time=time.localtime(time.time())[:6]),
                          "\n".join(self.record) + "\n")
        self.zip.close()


def _metadata_files():
    return {
        "METADATA": _metadata(),
        "WHEEL": "Wheel-Version: 1.0\nGenerator: smoe_build\nRoot-Is-Purelib: false\n"
                 "Tag: %s\n" % _tag(),
        "top_level.txt": NAME + "\n",
    }


def _package_modules():
    src = os.path.join(ROOT, "python", "smoe")
    return sorted(f for f in os.listdir(src) if f.endswith(".py"))


def _wheel_name():
    return "%s-%s-%s.whl" % (NAME, _version(), _tag())


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    progress = _Progress()
    try:
        lib = _library(config_settings, progress)
        name = _wheel_name()
        wheel = _Wheel(os.path.join(wheel_directory, name))
        for module in _package_modules():
            wheel.add_file("smoe/" + module, os.path.join(ROOT, "python", "smoe", module))
        wheel.add_file("smoe/libsmoe.so", lib)
        wheel.finish(_metadata_files())
        return name
    finally:
        progress.close()


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """python/ on sys.path (a .pth file) and build/libsmoe.so built: the
    library smoe/_lib.py finds in a source checkout."""
    progress = _Progress()
    try:
        if not os.environ.get("SMOE_LIBRARY"):
            build_library("build", config_settings, progress)
        name = _wheel_name()
        wheel = _Wheel(os.path.join(wheel_directory, name))
        wheel.add("_smoe_editable.pth", os.path.join(ROOT, "python") + "\n")
        wheel.finish(_metadata_files())
        return name
    finally:
        progress.close()


def _prepare_metadata(metadata_directory):
    info = os.path.join(metadata_directory, _dist_info())
    os.makedirs(info, exist_ok=True)
    for name, text in _metadata_files().items():
        with open(os.path.join(info, name), "w") as f:
            f.write(text)
    return _dist_info()


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _prepare_metadata(metadata_directory)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _prepare_metadata(metadata_directory)


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


# ------------------------------------------------------------ sdists

def _sdist_members():
    names = [f for f in _SDIST_FILES if os.path.isfile(os.path.join(ROOT, f))]
    for tree in _SDIST_TREES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, tree)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for f in sorted(files):
                if not f.endswith((".pyc", ".so", ".o")):
                    names.append(os.path.relpath(os.path.join(folder, f), ROOT))
    return names


def build_sdist(sdist_directory, config_settings=None):
    base = "%s-%s" % (NAME, _version())
    name = base + ".tar.gz"
    path = os.path.join(sdist_directory, name)
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for member in _sdist_members():
            tar.add(os.path.join(ROOT, member), arcname=base + "/" + member, recursive=False)
        data = _metadata().encode()
        info = tarfile.TarInfo(base + "/PKG-INFO")
        info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
        tar.addfile(info, io.BytesIO(data))
    return name


if __name__ == "__main__":
    # `python python/build_backend/smoe_build.py [BUILD_DIR]`: the library
    # alone, as a wheel build makes it (for timing; default build/python-cuda
    # or -cpu).
    print(build_library(sys.argv[1] if len(sys.argv) > 1 else "build/python-{config}"))

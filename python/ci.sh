#!/usr/bin/env bash
# The Python package's CI: builds libsmoe.so with the Makefile (as `make
# test` does: with the CUDA backends where nvcc exists, which the tests then
# leave unused without a GPU), installs PyTorch (the PyPI wheel, used on
# the CPU), pytest, numpy and transformers (whose MoE blocks, built from a
# config with random weights, check the weight loader; nothing is fetched
# from a model hub) into a virtual environment, installs the package from
# the repository root with `pip install .` (offline: the build backend needs
# no package), and runs python/tests with pytest.
#
# The install packages the build/libsmoe.so that `make lib` has just brought
# up to date (SMOE_LIBRARY), so CI compiles the CUDA kernels once;
# python/tests/test_packaging.py checks the build pip runs itself (CPU-only,
# in a copy of the sources: offline wheel, rebuild after a change, sdist).
#
# Environment: SMOE_PY_VENV, the virtual environment (default
# ~/.cache/smoe-py-venv, kept between runs: a second run installs nothing);
# PYTHON, the interpreter that makes it (default python3).
set -euo pipefail

cd "$(dirname "$0")/.."
root=$PWD
venv="${SMOE_PY_VENV:-$HOME/.cache/smoe-py-venv}"
python="${PYTHON:-python3}"
start=$(date +%s)

retry() {
    local n
    for n in 1 2 3; do
        if "$@"; then return 0; fi
        echo "python/ci.sh: attempt $n of '$*' failed" >&2
        sleep $((n * 10))
    done
    return 1
}

echo "== python: make lib"
make -j"$(nproc 2>/dev/null || echo 2)" lib

echo "== python: virtual environment $venv"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
# transformers: the version smoe.hf is tested with (smoe.hf.TESTED_TRANSFORMERS_VERSIONS;
# python/tests/test_hf.py builds its models from that version's classes)
tf=5.24.0
if ! "$venv/bin/python" -c "import torch, pytest, numpy, transformers as t; assert t.__version__ == '$tf'" \
        >/dev/null 2>&1; then
    t0=$(date +%s)
    retry "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch>=2.4" pytest \
        numpy "transformers==$tf"
    echo "installed torch, pytest, numpy, transformers $tf in $(($(date +%s) - t0)) s"
fi
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"

echo "== python: pip install . (from the repository root)"
t0=$(date +%s)
SMOE_LIBRARY="$root/build/libsmoe.so" "$venv/bin/python" -m pip install -q \
    --disable-pip-version-check --no-index --force-reinstall --no-deps "$root"
echo "installed smoe in $(($(date +%s) - t0)) s"
(cd /tmp && "$venv/bin/python" -m smoe)

echo "== python: pytest"
cd "$root"
export HF_HUB_OFFLINE=1
set +e
"$venv/bin/python" -m pytest python/tests -q -p no:cacheprovider
status=$?
set -e
echo "python/ci.sh: $(($(date +%s) - start)) s in all"
exit $status

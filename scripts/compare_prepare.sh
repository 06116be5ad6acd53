#!/usr/bin/env bash
# compare_prepare.sh: prepare, on this machine (network, no GPU), everything the
# GPU machine needs for the head-to-head with SonicMoE (issue 20), into the
# git-ignored folder .cmpwhl/, which scripts/compare_device.sh reads there.
#
#   scripts/compare_prepare.sh                 wheels, archive, precompiled kernels
#   scripts/compare_prepare.sh --no-precompile wheels and archive only (the device
#                                              then compiles SonicMoE's kernels:
#                                              minutes, see notes/compare.md)
#   scripts/compare_prepare.sh --archive-only  refresh clean.tar.xz and COMMIT
#                                              (after new commits), keep the rest
#   CMP_ROWS=models,all scripts/compare_prepare.sh   rows to precompile for
#
# .cmpwhl/ afterwards (carry [".cmpwhl"]; must stay under 64 MiB with the tree):
#   site.tar.xz         SonicMoE 0.1.2.post1 and the wheels it needs that the
#                       device's python3 (3.12, torch 2.11.0+cu130, triton 3.6.0,
#                       cuda-bindings 13.x) lacks, unpacked into one folder:
#                       quack-kernels 0.3.11, nvidia-cutlass-dsl(-libs-base)
#                       4.4.2, apache-tvm-ffi 0.1.15.post2, torch-c-dlpack-ext
#                       0.1.5 (notes/compare.md: why these versions)
#   clean.tar.xz        `git archive HEAD`: the device builds the committed sources
#   COMMIT              the commit archived (-dirty if src/include/python/bench or
#                       the Makefile had uncommitted changes; those are NOT in it)
#   sonic-cache.tar.xz  QuACK's and Triton's kernels for SonicMoE's first
#                       forward+backward on sm_90a (scripts/sonic_precompile.py),
#                       unpacked to /tmp/sonic-cache on the device
#
# Needs: python3 with pip (downloads), xz, git; for the precompile a Python 3.12
# (pyenv's here) to make a venv with torch 2.11.0, triton 3.6.0, cuda-bindings
# 13.3.1 ($CMP_VENV, default /tmp/venv-sonic; made if missing, ~2.5 GB of pip).
# Downloads are kept in $CMP_DL (default ~/.cache/smoe-cmp/dl), outside .cmpwhl.
set -euo pipefail

die() { echo "compare_prepare: $*" >&2; exit 1; }
step() { echo "== $(date +%T) $*"; }

PRECOMPILE=1
ARCHIVE_ONLY=0
for a in "$@"; do
    case "$a" in
    --no-precompile) PRECOMPILE=0 ;;
    --archive-only) ARCHIVE_ONLY=1 ;;
    -h | --help) sed -n '2,32p' "$0"; exit 0 ;;
    *) die "unknown argument $a (--no-precompile, --archive-only)" ;;
    esac
done

ROOT=$(git rev-parse --show-toplevel) || die "not in a git checkout"
cd "$ROOT"
W=.cmpwhl
DL=${CMP_DL:-$HOME/.cache/smoe-cmp/dl}
VENV=${CMP_VENV:-/tmp/venv-sonic}
PY312=${CMP_PY312:-/root/.pyenv/versions/3.12.1/bin/python3.12}
ROWS=${CMP_ROWS:-models,all}
SITE=$(mktemp -d /tmp/cmp-site.XXXXXX)
trap 'rm -rf "$SITE"' EXIT
LIMIT=$((64 * 1024 * 1024))

git check-ignore -q "$W/x" || die "$W/ is not git-ignored (.gitignore): it must never be committed"
git check-ignore -q .sonic-cache/x || die ".sonic-cache/ is not git-ignored"
mkdir -p "$W" "$DL"

archive() {
    step "git archive HEAD -> $W/clean.tar.xz"
    local commit
    commit=$(git rev-parse --short=12 HEAD)
    if [ -n "$(git status --porcelain -- src include python bench Makefile)" ]; then
        echo "   WARNING: uncommitted changes in src/include/python/bench/Makefile are not archived"
        commit="$commit-dirty"
    fi
    git archive --format=tar HEAD | xz -T2 -9 > "$W/clean.tar.xz.new" || die "git archive failed"
    mv "$W/clean.tar.xz.new" "$W/clean.tar.xz"
    echo "$commit" > "$W/COMMIT"
    echo "   commit $commit, $(du -k "$W/clean.tar.xz" | cut -f1) KiB"
}

if [ "$ARCHIVE_ONLY" = 1 ]; then
    [ -s "$W/site.tar.xz" ] || die "no $W/site.tar.xz: run without --archive-only first"
    archive
    exit 0
fi
rm -f "$W"/site.tar.xz "$W"/clean.tar.xz "$W"/sonic-cache.tar.xz "$W"/COMMIT

# 1. the wheels, for the device's CPython 3.12 on x86-64 Linux
WHEELS="sonic-moe==0.1.2.post1 quack-kernels==0.3.11 nvidia-cutlass-dsl==4.4.2
nvidia-cutlass-dsl-libs-base==4.4.2 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5"
step "pip download into $DL"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DL" $WHEELS || die "pip download failed"
for w in $WHEELS; do
    name=${w%%==*}; ver=${w##*==}
    f=$(ls "$DL"/"${name//-/_}"-"$ver"-*.whl 2>/dev/null | head -1)
    [ -n "$f" ] || die "wheel $w not in $DL after pip download"
    echo "   $(basename "$f") ($(du -k "$f" | cut -f1) KiB)"
done

# 2. unpacked into one folder (a wheel is a zip; none of these needs an entry
#    point or has a .data part), tarred and xz-compressed
step "unpack into $SITE, tar -> $W/site.tar.xz"
for w in $WHEELS; do
    name=${w%%==*}; ver=${w##*==}
    python3 -m zipfile -e "$(ls "$DL"/"${name//-/_}"-"$ver"-*.whl | head -1)" "$SITE" ||
        die "unzip $w failed"
done
[ -d "$SITE/sonicmoe" ] && [ -d "$SITE/quack" ] && [ -d "$SITE/nvidia_cutlass_dsl" ] ||
    die "unpacked site lacks sonicmoe/, quack/ or nvidia_cutlass_dsl/"
find "$SITE" -name __pycache__ -prune -exec rm -rf {} +
echo "   unpacked: $(du -sh "$SITE" | cut -f1)"
tar -C "$SITE" -cf - . | xz -T2 -9e > "$W/site.tar.xz" || die "tar site failed"

# 3. the committed sources
archive

# 4. SonicMoE's kernels, compiled here for sm_90a
if [ "$PRECOMPILE" = 1 ]; then
    if ! "$VENV/bin/python" -c "import torch, triton; assert torch.__version__.startswith('2.11.0') and triton.__version__ == '3.6.0'" 2>/dev/null; then
        step "make the venv $VENV (Python 3.12, torch 2.11.0, triton 3.6.0)"
        [ -x "$PY312" ] || die "no Python 3.12 at $PY312 (set CMP_PY312)"
        "$PY312" -m venv "$VENV" || die "venv failed"
        "$VENV/bin/pip" install -q torch==2.11.0 triton==3.6.0 cuda-bindings==13.3.1 \
            cuda-python numpy einops || die "pip install into $VENV failed"
    fi
    step "precompile SonicMoE's kernels for rows $ROWS (2 cores: about 2-4 minutes)"
    rm -rf /tmp/sonic-cache
    "$VENV/bin/python" scripts/sonic_precompile.py --site "$SITE" --out /tmp/sonic-cache \
        --jobs 2 --rows "$ROWS" --tar "$W/sonic-cache.tar.xz" || die "sonic_precompile failed"
else
    echo "   --no-precompile: the device compiles SonicMoE's kernels itself (slow)"
fi

# 5. what a device call carries: the tracked and untracked-not-ignored files plus
#    .cmpwhl; over 64 MiB the call would fail
step "sizes"
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null |
    awk '{s += $1} END {print s + 0}')
carried=$(find "$W" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
ls -l "$W"
printf "   working tree %.1f MiB + .cmpwhl %.1f MiB = %.1f MiB of 64 MiB\n" \
    "$(echo "$tree / 1048576" | bc -l)" "$(echo "$carried / 1048576" | bc -l)" \
    "$(echo "($tree + $carried) / 1048576" | bc -l)"
[ $((tree + carried)) -lt $LIMIT ] || die "over the 64 MiB a device call carries"
echo "ready: commit $(cat "$W/COMMIT"); on the GPU machine: scripts/compare_device.sh" \
    "(carry [\".cmpwhl\"], timeout_s 600)"

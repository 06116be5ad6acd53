#!/usr/bin/env bash
# compare_device.sh: the head-to-head with SonicMoE on the GPU machine (issue 20),
# from what scripts/compare_prepare.sh put in .cmpwhl/ here. One device call:
#
#   run  command: scripts/compare_device.sh     carry: [".cmpwhl"]   timeout_s: 600
#
# It unpacks the wheels to /tmp/cmp-site and the committed sources to
# /tmp/cmp-clean (no network needed), builds the library there (make lib, in
# the background), unpacks SonicMoE's precompiled kernels to /tmp/sonic-cache,
# checks the imports, runs bench/compare.py (of the archive) with smoe-sm90
# and sonicmoe on the public models' shapes, and prints last a table of
# same-call ratios (forward, backward, training-loop iteration, geometric
# means) with smoe's kernel path per row. Files in $OUT: compare.csv,
# compare.log, compare.err, build.log, sonic-new.tar.xz (kernels and QuACK
# autotune results the device added: put it in .cmpwhl/sonic-autotune.tar.xz
# to reuse this GPU's tuning next time).
#
# Environment: CMP_ROWS (default models; e.g. models,all or 7B-n256,DeepSeek-V3),
# CMP_IMPLS (default smoe-sm90,sonicmoe), CMP_BUDGET (seconds for the whole
# script, default 530: rows not started by then minus a margin are skipped and
# marked so in the CSV), CMP_ARGS (more compare.py arguments), CMP_PRE (a
# command compare.py runs under, e.g. an ncu command line: scripts/ncu_dw_pair.sh).
set -uo pipefail

T0=$(date +%s)
BUDGET=${CMP_BUDGET:-530}
ROWS=${CMP_ROWS:-models}
IMPLS=${CMP_IMPLS:-smoe-sm90,sonicmoe}
OUT=${OUT:-/tmp/cmp-out}
W=$PWD/.cmpwhl
C=/tmp/cmp-clean
SITE=/tmp/cmp-site
mkdir -p "$OUT"

left() { echo $((BUDGET - ($(date +%s) - T0))); }
say() { echo "== $(date -u +%T) [$(($(date +%s) - T0)) s] $*"; }
die() { echo "compare_device: FAILED: $*"; exit 1; }

# 0. what was carried, the machine
for f in site.tar.xz clean.tar.xz COMMIT; do
    [ -s "$W/$f" ] || die "missing .cmpwhl/$f: run scripts/compare_prepare.sh on the prepare machine and carry [\".cmpwhl\"]"
done
COMMIT=$(cat "$W/COMMIT")
say "commit $COMMIT, rows $ROWS, impls $IMPLS, budget $BUDGET s"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader ||
    die "nvidia-smi: no GPU"
python3 -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' ||
    die "python3 is not 3.12: the carried wheels are for CPython 3.12"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' ||
    die "torch/triton not importable or no CUDA device"

# 1. the committed sources, built in the background
rm -rf "$C" && mkdir -p "$C" && tar -xJf "$W/clean.tar.xz" -C "$C" || die "unpacking clean.tar.xz"
(cd "$C" && timeout 300 make -j"$(nproc)" BUILD=/tmp/cmp-sb lib >"$OUT/build.log" 2>&1
 echo $? >/tmp/cmp-build.rc) &
BUILD_PID=$!

# 2. the wheels and SonicMoE's precompiled kernels
rm -rf "$SITE"
python3 -c "import tarfile, sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='fully_trusted')" \
    "$W/site.tar.xz" "$SITE" || die "unpacking site.tar.xz"
for m in sonicmoe quack nvidia_cutlass_dsl tvm_ffi; do
    [ -d "$SITE/$m" ] || die "site.tar.xz lacks $m/ (a wheel missing from compare_prepare.sh?)"
done
touch /tmp/cmp-t0
if [ -s "$W/sonic-cache.tar.xz" ]; then
    rm -rf /tmp/sonic-cache
    tar -xJf "$W/sonic-cache.tar.xz" -C /tmp || die "unpacking sonic-cache.tar.xz"
    export QUACK_CACHE_DIR=/tmp/sonic-cache/quack TRITON_CACHE_DIR=/tmp/sonic-cache/triton
    say "precompiled kernels: $(find /tmp/sonic-cache/quack -name '*.o' | wc -l) QuACK, $(find /tmp/sonic-cache/triton -name '__grp__*' | wc -l) Triton"
else
    echo "WARNING: no .cmpwhl/sonic-cache.tar.xz: SonicMoE compiles its kernels on its first call (minutes; rows may be skipped)"
fi
if [ -s "$W/sonic-autotune.tar.xz" ]; then
    tar -xJf "$W/sonic-autotune.tar.xz" -C / || die "unpacking sonic-autotune.tar.xz"
    say "QuACK autotune results of an earlier run unpacked (SonicMoE does not re-time its candidates)"
fi
touch /tmp/cmp-t1
export PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/python_packages:$C/python
export PYTHONUNBUFFERED=1
python3 - <<'EOF' || die "SonicMoE does not import from the carried wheels"
import hashlib, importlib.metadata as md
from triton.runtime.cache import triton_key
import sonicmoe, quack, cutlass  # noqa: F401
from sonicmoe.functional import moe_TC_softmax_topk_layer  # noqa: F401
print("sonic-moe", md.version("sonic-moe"), "quack-kernels", md.version("quack-kernels"),
      "nvidia-cutlass-dsl", md.version("nvidia-cutlass-dsl"),
      "triton key", hashlib.sha256(triton_key().encode()).hexdigest()[:16])
EOF

# 3. the library
wait "$BUILD_PID"
[ "$(cat /tmp/cmp-build.rc 2>/dev/null)" = 0 ] || { tail -40 "$OUT/build.log"; die "make lib failed (build.log)"; }
export SMOE_LIBRARY=/tmp/cmp-sb/libsmoe.so
python3 -c 'import smoe; print("smoe", smoe.library_version(), smoe.library_path())' ||
    die "smoe does not load $SMOE_LIBRARY"
say "built and imported"

# 4. the comparison: rows not started by its --time-budget are skipped; the
#    timeout leaves time to print the table from the CSV if it is cut short
RUN_BUDGET=$(($(left) - 80))
RUN_LIMIT=$(($(left) - 20))
[ "$RUN_BUDGET" -gt 30 ] || die "only $(left) s left before compare.py"
say "compare.py: --time-budget $RUN_BUDGET, timeout $RUN_LIMIT"
# shellcheck disable=SC2086
timeout -k 5 "$RUN_LIMIT" ${CMP_PRE:-} python3 "$C/bench/compare.py" --impls "$IMPLS" --rows "$ROWS" \
    --commit "$COMMIT" --time-budget "$RUN_BUDGET" --csv "$OUT/compare.csv" ${CMP_ARGS:-} \
    2>"$OUT/compare.err" | tee "$OUT/compare.log"
RC=${PIPESTATUS[0]}
[ "$RC" = 124 ] || [ "$RC" = 137 ] && echo "WARNING: compare.py hit the timeout: the row in progress is lost"
tr '\r' '\n' <"$OUT/compare.err" | grep -v '^[[:space:]]*$' | tail -3

# 5. what SonicMoE compiled here (0 when the precompiled cache matched), and
#    the new files (autotune results, launchers) for reuse
echo "new QuACK .o: $(find /tmp/sonic-cache/quack -name '*.o' -newer /tmp/cmp-t1 2>/dev/null | wc -l);" \
    "new Triton kernels: $(find /tmp/sonic-cache/triton -name '__grp__*' -newer /tmp/cmp-t1 2>/dev/null | wc -l)"
find /tmp/sonic-cache -type f -newer /tmp/cmp-t1 ! -name '*.lock' ! -name '*.ttir' ! -name '*.ttgir' \
    ! -name '*.llir' ! -name '*.ptx' ! -name '*.source' 2>/dev/null |
    tar -cJf "$OUT/sonic-new.tar.xz" -T - 2>/dev/null
say "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"

# 6. last: the same-call ratios, from the CSV (also when compare.py was cut short)
[ -s "$OUT/compare.csv" ] || die "no compare.csv"
A=${IMPLS%%,*}
python3 "$C/bench/compare.py" --table-only "$OUT/compare.csv" --ratio "$A/sonicmoe"
exit "$RC"

#!/usr/bin/env bash
# Build here (no GPU needed) and stage what the GPU scripts run in .prebuilt/,
# so a device call can skip the build:
#   scripts/prebuild.sh      then on the device (carry [".prebuilt"]):
#   PREBUILT=1 bash scripts/device_check.sh sm90
# The staged binaries are those of the working tree as it is now; the commit
# and a hash of the sources go into .prebuilt/STAMP for the device log.
set -euo pipefail
make -j"$(nproc)" all
st=$(mktemp -d)
mkdir -p "$st/tests/gpu"
cp -a build/libsmoe.so build/smoe_bench build/smoe_run build/smoe_ep_bench build/bench_gemm "$st/"
for t in $(make -s print-gpu-tests); do cp -a "$t" "$st/tests/gpu/"; done
{ echo "commit $(git rev-parse --short HEAD), $(git status --porcelain --untracked-files=no | wc -l) modified files"
  echo "sources $(git ls-files -z src include bench tests | xargs -0 cat | sha1sum | cut -c1-12)"
  echo "built $(date -u '+%F %H:%M') UTC"; } > "$st/STAMP"
# every program links the whole library statically (~12 MB of kernels each):
# xz -9's 64 MiB dictionary spans the copies, so the set (126 MB) travels
# in about 11 MB (-2 left 68 MB, over the 64 MiB a call carries)
mkdir -p .prebuilt && rm -f .prebuilt/prebuilt.tar.xz .prebuilt/STAMP
tar -cf - -C "$st" . | xz -T0 -9 > .prebuilt/prebuilt.tar.xz
cp "$st/STAMP" .prebuilt/
rm -rf "$st"
cat .prebuilt/STAMP; du -sh .prebuilt

# smoe build. `make` builds the static and shared library and the programs;
# the CUDA backends are built only where nvcc exists (SMOE_CUDA=0 forces a
# CPU-only build). `make run` runs the main job, `make test` the CPU tests.

VERSION_MAJOR := $(shell sed -n 's/^\#define SMOE_VERSION_MAJOR \([0-9]*\)/\1/p' include/smoe.h)
VERSION_MINOR := $(shell sed -n 's/^\#define SMOE_VERSION_MINOR \([0-9]*\)/\1/p' include/smoe.h)
VERSION_PATCH := $(shell sed -n 's/^\#define SMOE_VERSION_PATCH \([0-9]*\)/\1/p' include/smoe.h)
VERSION := $(VERSION_MAJOR).$(VERSION_MINOR).$(VERSION_PATCH)

# (the flags stamp's rule comes first below: `make` alone builds all)
.DEFAULT_GOAL := all

CC      ?= cc
BUILD   ?= build
OPT     ?= -O2
# OpenMP for the CPU backend's loops; empty for the ThreadSanitizer and fuzz
# builds (the loops then run serially, the pragmas ignored).
OPENMP  ?= -fopenmp
CFLAGS  ?= $(OPT) -g
CFLAGS  += -std=c11 -Wall -Wextra -Wno-unused-parameter -Wno-unknown-pragmas -fPIC $(OPENMP) \
           -fvisibility=hidden -Iinclude -Isrc -D_GNU_SOURCE $(SANFLAGS)
LDLIBS  += $(SANFLAGS) $(OPENMP) -lm -lpthread

NVCC    ?= $(shell command -v nvcc 2>/dev/null)
ifeq ($(NVCC),)
SMOE_CUDA ?= 0
else
SMOE_CUDA ?= 1
endif

CPU_SRC  := $(wildcard src/*.c src/cpu/*.c)
CPU_OBJ  := $(CPU_SRC:%.c=$(BUILD)/%.o)
CUDA_OBJ :=

ifeq ($(SMOE_CUDA),1)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
# Portable kernels: sm_80 machine code plus sm_90 (H100 runs it natively).
CUDA_ARCH_PORTABLE ?= -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90
# Hopper-only kernels (wgmma, setmaxnreg need the "a" target).
CUDA_ARCH_SM90 ?= -gencode=arch=compute_90a,code=sm_90a
NVCCFLAGS ?= -O3 -lineinfo
NVCCFLAGS += -std=c++17 -Xcompiler -fPIC,-fvisibility=hidden -Iinclude -Isrc -DSMOE_WITH_CUDA \
             --expt-relaxed-constexpr
# nvcc compiles a file's -gencode targets in parallel threads (the portable
# kernels have two), so a parallel build waits less for its longest file.
NVCC_THREADS ?= 0
NVCCFLAGS += --threads $(NVCC_THREADS)
CFLAGS   += -DSMOE_WITH_CUDA -I$(CUDA_HOME)/include
CU_SRC    := $(wildcard src/cuda/*.cu)
CU90_SRC  := $(wildcard src/cuda/sm90/*_sm90.cu)
CUDA_OBJ  := $(CU_SRC:%.cu=$(BUILD)/%.o) $(CU90_SRC:%.cu=$(BUILD)/%.o)
ifneq ($(CU90_SRC),)
NVCCFLAGS += -DSMOE_WITH_SM90
CFLAGS    += -DSMOE_WITH_SM90
endif
# A debugging build's hang detector for the Hopper kernels' barrier waits
# (ptx_sm90.cuh): a wait stuck for MS milliseconds says where, e.g.
#   make BUILD=build-wait SM90_WAIT_CHECK=3000 build-wait/tests/gpu/test_gemm_sm90
ifneq ($(SM90_WAIT_CHECK),)
NVCCFLAGS += -DSMOE_SM90_WAIT_CHECK=$(SM90_WAIT_CHECK)
endif
LDLIBS    += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublas -lcudart -lstdc++ -ldl
endif

LIB_OBJ := $(CPU_OBJ) $(CUDA_OBJ)

# A CPU-only build (SMOE_CUDA=0) and a CUDA build share $(BUILD): every object
# depends on a stamp named by a hash of the flags, so switching rebuilds
# instead of linking objects compiled for the other configuration.
FLAGS_STAMP := $(BUILD)/.flags-$(shell echo '$(SMOE_CUDA) $(CFLAGS) $(NVCCFLAGS)' | cksum | cut -d' ' -f1)
$(FLAGS_STAMP):
	@mkdir -p $(BUILD) && rm -f $(BUILD)/.flags-* && touch $@
LIB_A   := $(BUILD)/libsmoe.a
LIB_SO  := $(BUILD)/libsmoe.so

TEST_SRC  := $(wildcard tests/test_*.c)
TEST_BIN  := $(TEST_SRC:tests/%.c=$(BUILD)/tests/%)
PROGS := $(BUILD)/smoe_run $(BUILD)/example
# GPU tests and the benchmark need the CUDA runtime.
ifeq ($(SMOE_CUDA),1)
GPU_TEST_SRC := $(wildcard tests/gpu/test_*.c)
GPU_TEST_BIN := $(GPU_TEST_SRC:tests/gpu/%.c=$(BUILD)/tests/gpu/%)
# GPU tests written in CUDA (kernels of their own, e.g. reference kernels).
GPU_TEST_CU  := $(wildcard tests/gpu/test_*.cu)
GPU_TEST_BIN += $(GPU_TEST_CU:tests/gpu/%.cu=$(BUILD)/tests/gpu/%)
PROGS += $(if $(wildcard bench/bench.c),$(BUILD)/smoe_bench) $(BUILD)/smoe_ep_bench
PROGS += $(BUILD)/nccl_overlap_probe $(BUILD)/bench_gemm
endif

.PHONY: all lib run test test-gpu sanitize fuzz bench clean print-version print-gpu-tests \
	install uninstall install-check
all: lib $(PROGS) $(TEST_BIN) $(GPU_TEST_BIN)
lib: $(LIB_A) $(LIB_SO)

print-version:
	@echo $(VERSION)

# make install [PREFIX=/usr/local] [DESTDIR=...]: the header, both
# libraries and a pkg-config file (`pkg-config --cflags --libs smoe`; the
# shared library carries its CUDA dependencies, a static link needs
# `pkg-config --static`).
PREFIX     ?= /usr/local
LIBDIR     ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
install: lib
	install -d $(DESTDIR)$(LIBDIR)/pkgconfig $(DESTDIR)$(INCLUDEDIR)
	install -m 644 include/smoe.h $(DESTDIR)$(INCLUDEDIR)/smoe.h
	install -m 644 $(LIB_A) $(DESTDIR)$(LIBDIR)/libsmoe.a
	install -m 755 $(LIB_SO) $(DESTDIR)$(LIBDIR)/libsmoe.so
	printf '%s\n' 'prefix=$(PREFIX)' 'libdir=$(LIBDIR)' 'includedir=$(INCLUDEDIR)' '' \
	  'Name: smoe' 'Description: Mixture-of-Experts layer, forward and backward (CPU, CUDA)' \
	  'Version: $(VERSION)' 'Cflags: -I$${includedir}' 'Libs: -L$${libdir} -lsmoe' \
	  'Libs.private: $(strip $(LDLIBS))' > $(DESTDIR)$(LIBDIR)/pkgconfig/smoe.pc

uninstall:
	rm -f $(DESTDIR)$(INCLUDEDIR)/smoe.h $(DESTDIR)$(LIBDIR)/libsmoe.a \
	  $(DESTDIR)$(LIBDIR)/libsmoe.so $(DESTDIR)$(LIBDIR)/pkgconfig/smoe.pc

# What CI runs: install into a scratch prefix, build examples/example.c
# against it with pkg-config alone (shared and static), run both.
install-check: lib
	@d=$$(mktemp -d) && $(MAKE) -s install PREFIX=$$d && \
	export PKG_CONFIG_PATH=$$d/lib/pkgconfig && \
	$(CC) -std=c11 examples/example.c -o $$d/ex_shared $$(pkg-config --cflags --libs smoe) \
	  -lm -Wl,-rpath,$$d/lib && \
	$(CC) -std=c11 examples/example.c -o $$d/ex_static $$(pkg-config --cflags smoe) \
	  $$d/lib/libsmoe.a $$(pkg-config --static --libs smoe | sed 's/ -lsmoe / /') -lm && \
	$$d/ex_shared > $$d/out1 && $$d/ex_static > $$d/out2 && cmp $$d/out1 $$d/out2 && \
	echo "install-check: smoe $$(pkg-config --modversion smoe) installed, example built (shared, static) and run: same output" && \
	rm -rf $$d

# The GPU test programs (scripts/prebuild.sh stages them for the device).
print-gpu-tests:
	@echo $(GPU_TEST_BIN)

$(BUILD)/%.o: %.c include/smoe.h src/smoe_internal.h $(wildcard src/*.h src/cpu/*.h) $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/src/cuda/sm90/%.o: src/cuda/sm90/%.cu include/smoe.h src/smoe_internal.h src/routing_math.h $(wildcard src/cuda/*.h src/cuda/*.cuh src/cuda/sm90/*.cuh) $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) $(CUDA_ARCH_SM90) -c $< -o $@

$(BUILD)/src/cuda/%.o: src/cuda/%.cu include/smoe.h src/smoe_internal.h src/routing_math.h $(wildcard src/cuda/*.h src/cuda/*.cuh src/cuda/portable/*.cuh) $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) $(CUDA_ARCH_PORTABLE) -c $< -o $@

$(LIB_A): $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(LIB_SO): $(LIB_OBJ)
	$(CC) -shared -o $@ $^ $(LDLIBS)

$(BUILD)/smoe_run: bench/run.c bench/grid.h $(LIB_A)
	$(CC) $(CFLAGS) $< -o $@ $(LIB_A) $(LDLIBS)

$(BUILD)/smoe_bench: bench/bench.c bench/grid.h $(LIB_A)
	$(CC) $(CFLAGS) $< -o $@ $(LIB_A) $(LDLIBS)

$(BUILD)/smoe_ep_bench: bench/ep_bench.c bench/grid.h bench/cuda_ok.h $(LIB_A)
	$(CC) $(CFLAGS) $< -o $@ $(LIB_A) $(LDLIBS)

# NCCL beside a kernel that holds most SMs (what the EP overlap needs)
$(BUILD)/nccl_overlap_probe: bench/nccl_overlap_probe.cu bench/cuda_ok.h
	$(NVCC) -O2 $(CUDA_ARCH_PORTABLE) $< -o $@ -ldl -lpthread

# NCCL's copy-engine all-to-all beside cuBLAS GEMMs (not in `all`: it
# needs nccl.h, NCCL >= 2.28 and cuBLAS)
$(BUILD)/nccl_ce_probe: bench/nccl_ce_probe.cu bench/cuda_ok.h
	$(NVCC) -O2 $(CUDA_ARCH_PORTABLE) $< -o $@ -lcublas -ldl -lpthread

$(BUILD)/example: examples/example.c $(LIB_A)
	$(CC) $(CFLAGS) $< -o $@ $(LIB_A) $(LDLIBS)

$(BUILD)/tests/%: tests/%.c $(wildcard tests/*.h) $(LIB_A)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests $< -o $@ $(LIB_A) $(LDLIBS)

$(BUILD)/tests/gpu/%: tests/gpu/%.c $(wildcard tests/*.h tests/gpu/*.h) $(LIB_A)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Itests $< -o $@ $(LIB_A) $(LDLIBS)

$(BUILD)/tests/gpu/%: tests/gpu/%.cu $(wildcard tests/*.h tests/gpu/*.h) $(LIB_A)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) $(CUDA_ARCH_PORTABLE) -Itests $< -o $@ $(LIB_A) -Xcompiler -fopenmp \
	  -lcublas -lm -lpthread -ldl

# The main job: one layer forward and backward on the best backend, checked
# against the reference. ARGS picks the configuration (see README.md).
run: $(BUILD)/smoe_run
	$(BUILD)/smoe_run $(ARGS)

test: $(TEST_BIN) $(BUILD)/example
	@set -e; pass=0; fail=0; \
	for t in $(TEST_BIN); do \
	  if $$t; then pass=$$((pass+1)); else fail=$$((fail+1)); echo "FAILED: $$t"; fi; \
	done; \
	if $(BUILD)/example >/dev/null; then pass=$$((pass+1)); else fail=$$((fail+1)); echo "FAILED: example"; fi; \
	echo "$$pass passed, $$fail failed"; test $$fail -eq 0

test-gpu: $(GPU_TEST_BIN)
	@set -e; pass=0; fail=0; \
	for t in $(GPU_TEST_BIN); do \
	  if $$t; then pass=$$((pass+1)); else fail=$$((fail+1)); echo "FAILED: $$t"; fi; \
	done; \
	echo "$$pass passed, $$fail failed"; test $$fail -eq 0

bench: $(BUILD)/smoe_bench
	$(BUILD)/smoe_bench $(ARGS)

# The grouped GEMMs alone, each row of both families' tile tables, against
# cuBLAS (bench/bench_gemm.cu; `make bench-gemm ARGS="--shape 7B --all-rows"`).
# It shares the GPU tests' helpers (tests/gpu/testutil_cuda.h).
ifeq ($(SMOE_CUDA),1)
.PHONY: bench-gemm
bench-gemm: $(BUILD)/bench_gemm
	$(BUILD)/bench_gemm $(ARGS)

$(BUILD)/bench_gemm: bench/bench_gemm.cu src/cuda/gemm.h $(wildcard tests/*.h tests/gpu/*.h) $(LIB_A)
	$(NVCC) $(NVCCFLAGS) $(CUDA_ARCH_PORTABLE) -Itests -Itests/gpu $< -o $@ $(LIB_A) \
	  -Xcompiler -fopenmp -lcublas -lm -lpthread -ldl
endif

# C-ABI shim over the grouped-GEMM launcher tables (bench/gemm_shim.cu),
# a shared library with libsmoe.a linked in, for bench/gemm_vs_torch.py.
ifeq ($(SMOE_CUDA),1)
.PHONY: gemm-shim
gemm-shim: $(BUILD)/libsmoe_gemm_shim.so

$(BUILD)/bench/gemm_shim.o: bench/gemm_shim.cu src/cuda/gemm.h include/smoe.h src/smoe_internal.h
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) $(CUDA_ARCH_PORTABLE) -c $< -o $@

$(BUILD)/libsmoe_gemm_shim.so: $(BUILD)/bench/gemm_shim.o $(LIB_A)
	$(CC) -shared -o $@ $< $(LIB_A) $(LDLIBS)
endif

# The CPU tests again under AddressSanitizer and UndefinedBehaviorSanitizer,
# then the tests that run threads (one layer from several threads, the
# expert-parallel ranks as threads) under ThreadSanitizer, without OpenMP
# (whose runtime ThreadSanitizer cannot see into).
sanitize:
	$(MAKE) BUILD=build-san SMOE_CUDA=0 OPT=-O1 \
	  SANFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all" test
	$(MAKE) BUILD=build-tsan SMOE_CUDA=0 OPT=-O1 OPENMP= SANFLAGS="-fsanitize=thread" \
	  build-tsan/tests/test_threads build-tsan/tests/test_bad_input build-tsan/tests/test_ep
	TSAN_OPTIONS="halt_on_error=1 exitcode=66" build-tsan/tests/test_threads
	TSAN_OPTIONS="halt_on_error=1 exitcode=66" build-tsan/tests/test_bad_input
	TSAN_OPTIONS="halt_on_error=1 exitcode=66" build-tsan/tests/test_ep

# libFuzzer targets (tests/fuzz), clang with AddressSanitizer and
# UndefinedBehaviorSanitizer, over a CPU-only library built the same way.
# Each runs FUZZ_SECONDS from its corpus in tests/fuzz/corpus (read only:
# new inputs go to build-fuzz/corpus); a finding stops `make` with the
# input saved as build-fuzz/crash-*.
FUZZ_CC      ?= clang
FUZZ_SECONDS ?= 60
FUZZ_SAN     := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
FUZZ_TARGETS := $(patsubst tests/fuzz/%.c,%,$(wildcard tests/fuzz/fuzz_*.c))

fuzz:
	$(MAKE) BUILD=build-fuzz SMOE_CUDA=0 CC=$(FUZZ_CC) OPT=-O1 OPENMP= \
	  SANFLAGS="$(FUZZ_SAN) -fsanitize=fuzzer-no-link" build-fuzz/libsmoe.a
	@set -e; for t in $(FUZZ_TARGETS); do \
	  $(FUZZ_CC) -g -O1 $(FUZZ_SAN) -fsanitize=fuzzer -std=c11 -D_GNU_SOURCE -Iinclude -Itests \
	    tests/fuzz/$$t.c build-fuzz/libsmoe.a -lm -lpthread -o build-fuzz/$$t; \
	done
	@set -e; for t in $(FUZZ_TARGETS); do \
	  mkdir -p build-fuzz/corpus/$$t tests/fuzz/corpus/$$t; \
	  echo "== $$t ($(FUZZ_SECONDS) s)"; \
	  rc=0; build-fuzz/$$t -max_total_time=$(FUZZ_SECONDS) -timeout=20 -rss_limit_mb=2048 \
	    -print_final_stats=1 -artifact_prefix=build-fuzz/ \
	    build-fuzz/corpus/$$t tests/fuzz/corpus/$$t > build-fuzz/$$t.log 2>&1 || rc=$$?; \
	  grep -E '^(#[0-9]+.*DONE|stat::number_of_executed_units|stat::new_units_added)' \
	    build-fuzz/$$t.log || true; \
	  if [ $$rc -ne 0 ]; then tail -n 40 build-fuzz/$$t.log; echo "FUZZ FINDING: $$t"; exit 1; fi; \
	done

clean:
	rm -rf build build-san build-tsan build-fuzz build-wait

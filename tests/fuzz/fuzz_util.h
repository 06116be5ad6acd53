/*
 * fuzz_util.h -- what the libFuzzer targets in tests/fuzz share: a reader
 * that turns the fuzzer's bytes into values (zeros once they run out), and
 * a check that aborts with a message (libFuzzer then saves the input).
 *
 * The targets run the CPU backend, built with clang's AddressSanitizer and
 * UndefinedBehaviorSanitizer (`make fuzz`); each checks an oracle of its
 * own, so a wrong answer is a finding as much as a crash is.
 */
#ifndef SMOE_FUZZ_UTIL_H
#define SMOE_FUZZ_UTIL_H

#include "smoe.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct fz {
    const uint8_t *p;
    size_t n;
} fz;

static uint64_t fz_bits(fz *r, int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++) {
        uint8_t b = 0;
        if (r->n) {
            b = *r->p++;
            r->n--;
        }
        v |= (uint64_t)b << (8 * i);
    }
    return v;
}

static uint32_t fz_u8(fz *r) { return (uint32_t)fz_bits(r, 1); }
static uint32_t fz_u16(fz *r) { return (uint32_t)fz_bits(r, 2); }
static uint32_t fz_u32(fz *r) { return (uint32_t)fz_bits(r, 4); }

/* an integer in [lo, hi] */
static int64_t fz_range(fz *r, int64_t lo, int64_t hi) {
    uint64_t span = (uint64_t)(hi - lo) + 1;
    uint64_t v = fz_bits(r, span > 65536 ? 4 : span > 256 ? 2 : 1);
    return lo + (int64_t)(v % span);
}

/* A size the validation must handle: usually small, sometimes zero,
 * negative, near a power of two, or huge. */
static int64_t fz_size(fz *r, int64_t small_max) {
    uint32_t kind = fz_u8(r) % 16;
    if (kind < 10) return fz_range(r, 1, small_max);
    if (kind == 10) return 0;
    if (kind == 11) return -fz_range(r, 1, 1 << 20);
    if (kind == 12) return ((int64_t)1 << fz_range(r, 20, 62)) + fz_range(r, -2, 2);
    if (kind == 13) return INT32_MAX + fz_range(r, -2, 2);
    if (kind == 14) return INT64_MAX - fz_range(r, 0, 3);
    return (int64_t)fz_bits(r, 8);
}

/* a float: usually moderate, sometimes any bit pattern (NaN, inf, huge) */
static float fz_float(fz *r) {
    uint32_t kind = fz_u8(r) % 8;
    if (kind == 0) {
        uint32_t u = fz_u32(r);
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return ((float)fz_u16(r) - 32768.0f) / 8192.0f;
}

#define FZ_CHECK(cond, ...)                                                          \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "fuzz check failed at %s:%d: %s\n  ", __FILE__, __LINE__, \
                    #cond);                                                          \
            fprintf(stderr, __VA_ARGS__);                                            \
            fprintf(stderr, "\n  smoe_last_error: %s\n", smoe_last_error());        \
            abort();                                                                 \
        }                                                                            \
    } while (0)

#endif /* SMOE_FUZZ_UTIL_H */

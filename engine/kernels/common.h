// Headers, bf16 <-> fp32, prefetch: a section of the CPU library, included once by cpu_kernels.cpp (one translation unit,
// so the sections' static functions inline into each other). See cpu_kernels.cpp for the whole map.
#pragma once

#include <algorithm>
#include <cmath>
#include <math.h>
// engine/kernels/build.py compiles without -ffinite-math-only (NaN and inf must stay what they are: the
// engine fails a request whose logits went non-finite), so __FAST_MATH__ is not defined and glibc does not
// declare its vector expf (libmvec, which handles NaN and inf as expf does): declared here, so the loops
// over exp still vectorise
#if defined(__x86_64__) && defined(__GLIBC__) && !defined(__FAST_MATH__)
extern "C" float expf(float) noexcept __attribute__((__simd__("notinbranch")));
#endif
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__) || (defined(__AMX_TILE__) && defined(__AMX_BF16__))
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#endif

static inline float to_float(float x) { return x; }
static inline float to_float(uint16_t bf16) {          // bfloat16 is the top half of a float32
    uint32_t bits = uint32_t(bf16) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
static inline void store(float* p, float x) { *p = x; }
static inline void store(uint16_t* p, float x) {       // round to nearest even, as torch rounds
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    bits += 0x7fff + ((bits >> 16) & 1);
    *p = uint16_t(bits >> 16);
}

// The largest of x[0] .. x[n - 1] (n >= 1), for a softmax: sixteen running maxima side by side, so the loop
// vectorises although the build does not assume finite math (a single running maximum is a chain of scalar
// max instructions, a fifth of decode attention's time). A NaN in x may be passed over here; it still makes
// its softmax NaN, through its own exp and the sum.
static inline float max_of(const float* x, int64_t n) {
    float m[16];
    for (int l = 0; l < 16; ++l) m[l] = x[0];
    int64_t t = 1;
    for (; t + 16 <= n; t += 16)
#pragma omp simd
        for (int l = 0; l < 16; ++l) m[l] = x[t + l] > m[l] ? x[t + l] : m[l];
    for (; t < n; ++t) m[0] = x[t] > m[0] ? x[t] : m[0];
    float r = m[0];
    for (int l = 1; l < 16; ++l) r = m[l] > r ? m[l] : r;
    return r;
}

// The next blocks are elsewhere in memory: ask for them while this one is computed (blocks are a few KB,
// too short for the hardware prefetcher to find on its own; without this the kernel waits on memory).
// The next one into L1; the one AHEAD blocks on into L2, so that memory's latency is hidden too.
constexpr int AHEAD = 4;
template <int LEVEL, typename T>
static inline void prefetch(const T* p, int count) {
    for (int64_t x = 0; x < int64_t(count) * int64_t(sizeof(T)); x += 64)
        __builtin_prefetch((const char*)p + x, 0, LEVEL);
}

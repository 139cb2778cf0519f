// 2. the elementwise chains: a section of the CPU library, included once by cpu_kernels.cpp (one translation unit,
// so the sections' static functions inline into each other). See cpu_kernels.cpp for the whole map.
#pragma once
#include "common.h"

// ---- 2. bf16 elementwise chains, one row per iteration (rows in parallel once there are enough) ----
static inline float round_bf16(float x) {                // x rounded to bf16, as torch rounds a bf16 op's result
    uint16_t b;
    store(&b, x);
    return to_float(b);
}
template <typename T>                                      // a T op's result: bf16 rounds it, fp32 keeps it
static inline float rounded(float x) { return std::is_same_v<T, uint16_t> ? round_bf16(x) : x; }
static inline bool parallel(int64_t rows, int64_t width) { return rows * width >= (1 << 16); }

// norm(x + residual) and x + residual (models.llama.add_rms_norm), or norm(x) when residual is null:
// the sum rounded to bf16; the norm in fp32, rounded, then times the weight, rounded
static void rms_norm_rows(const uint16_t* x, const uint16_t* residual, const uint16_t* w, uint16_t* out,
                          uint16_t* sum_out, int64_t rows, int hidden, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (parallel(rows, hidden))
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* xr = x + r * hidden;
        std::vector<float> v(hidden);
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int c = 0; c < hidden; ++c) {
            float a = to_float(xr[c]);
            if (residual) a = round_bf16(a + to_float(residual[r * hidden + c]));
            v[c] = a;
            ss += a * a;
        }
        const float inv = 1.f / std::sqrt(ss / hidden + eps);
#pragma omp simd
        for (int c = 0; c < hidden; ++c) {
            if (sum_out) store(&sum_out[r * hidden + c], v[c]);
            store(&out[r * hidden + c], to_float(w[c]) * round_bf16(v[c] * inv));
        }
    }
}

// silu(gate) * up over (rows, 2 * inter) = [gate | up] (models.llama.silu_and_mul)
template <typename T>
static void silu_and_mul_rows(const T* gate_up, T* out, int64_t rows, int inter, int threads) {
#pragma omp parallel for num_threads(threads) if (parallel(rows, inter))
    for (int64_t r = 0; r < rows; ++r) {
        const T* g = gate_up + r * 2 * inter;
        const T* u = g + inter;
#pragma omp simd
        for (int c = 0; c < inter; ++c) {
            // exp's argument capped below fp32's overflow: the fast-math division is a reciprocal and a
            // Newton step, which turns 1 / inf into NaN; past the cap silu(a) is below 1e-36 either way
            const float a = to_float(g[c]);
            store(&out[r * inter + c], rounded<T>(a / (1.f + std::exp(std::min(-a, 88.f)))) * to_float(u[c]));
        }
    }
}

// x * cos + roll(x, D / 2) * sin per head (models.llama.apply_rope; sin's first half negated);
// x: (rows, heads, D) with row stride x_stride; cos, sin: (rows, D); out: (rows, heads, D), contiguous
template <typename T>
static void rope_rows(const T* x, int64_t x_stride, const T* cos, const T* sin, T* out, int64_t rows, int heads, int D,
                      int threads) {
    const int half = D / 2;
#pragma omp parallel for num_threads(threads) if (parallel(rows, int64_t(heads) * D))
    for (int64_t r = 0; r < rows; ++r)
        for (int h = 0; h < heads; ++h) {
            const T* xh = x + r * x_stride + int64_t(h) * D;
            const T *c = cos + r * D, *sn = sin + r * D;
            T* oh = out + (r * heads + h) * D;
            // the two halves apart, so that each loop reads its partner half at a fixed offset
#pragma omp simd
            for (int d = 0; d < half; ++d)
                store(&oh[d], rounded<T>(to_float(xh[d]) * to_float(c[d])) +
                                  rounded<T>(to_float(xh[d + half]) * to_float(sn[d])));
#pragma omp simd
            for (int d = half; d < D; ++d)
                store(&oh[d], rounded<T>(to_float(xh[d]) * to_float(c[d])) +
                                  rounded<T>(to_float(xh[d - half]) * to_float(sn[d])));
        }
}

// The norm in fp32 (F.rms_norm), nothing rounded between the ops: the same values up to the last bit of an
// fp32 rsqrt (SiLU-and-multiply and RoPE above take fp32 as they are, rounding nowhere)
static void rms_norm_rows(const float* x, const float* residual, const float* w, float* out, float* sum_out,
                          int64_t rows, int hidden, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (parallel(rows, hidden))
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * hidden;
        float* v = sum_out ? sum_out + r * hidden : out + r * hidden;     // the sum, then normed in place
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int c = 0; c < hidden; ++c) {
            const float a = residual ? xr[c] + residual[r * hidden + c] : xr[c];
            v[c] = a;
            ss += a * a;
        }
        const float inv = 1.f / std::sqrt(ss / hidden + eps);
#pragma omp simd
        for (int c = 0; c < hidden; ++c) out[r * hidden + c] = v[c] * inv * w[c];
    }
}

// 3. linears of a decode step's few rows: a section of the CPU library, included once by cpu_kernels.cpp (one translation unit,
// so the sections' static functions inline into each other). See cpu_kernels.cpp for the whole map.
#pragma once
#include "common.h"

// ---- 3a. bf16 linears on AMX tiles: y = x w^T for a decode step's few rows ----
//
// At 1 to 32 rows a linear only streams its weights: each weight is used by as many multiply-adds as
// there are rows. oneDNN's kernels read the default model's weights at 13-16 GB/s there; this one
// reads them in the order it uses them, so the hardware prefetcher keeps up, at 18-25 GB/s.
//
// The weights are laid out once (pack_amx_bf16) as the tile instruction wants its second operand: a
// 16 x 32 block of w (16 output columns, 32 inputs) is one 1 KB tile of 16 rows, row r holding the
// pairs (w[n][2r], w[n][2r + 1]) for its 16 columns n. Columns go in groups of four blocks (64 outputs);
// a group's tiles lie in the order the loop reads them: for every 32 inputs, its four blocks.
//
//   tiles 0-3: the fp32 sums of 16 rows x 4 column blocks
//   tile 4:    16 rows of x, 32 inputs (rows past the last are zeros)
//   tiles 5-6: a block of weights, in turn
//
// The sums run over the inputs in order, 32 at a time, with the instruction oneDNN's own AMX kernels
// use, and are rounded to bf16 once at the end: bit for bit the values of oneDNN's tile kernels behind
// F.linear at these row counts (at one row F.linear takes another kernel, which sums in another order:
// reference.linear_tiles). Checked on a probe when a model is packed (fast_paths.amx_linears_work). Threads take
// column groups; each sets up its own tiles.
static int64_t amx_offset(int64_t group, int64_t k_blocks) { return 4 * group * k_blocks * 512; }

static void pack_amx(const uint16_t* w, int64_t N, int64_t K, uint16_t* out) {
    const int64_t NB = N / 16, KB = K / 32;
    for (int64_t g = 0; 4 * g < NB; ++g) {
        const int64_t blocks = std::min<int64_t>(4, NB - 4 * g);
        uint16_t* o = out + amx_offset(g, KB);
        for (int64_t kb = 0; kb < KB; ++kb)
            for (int64_t j = 0; j < blocks; ++j, o += 512)
                for (int r = 0; r < 16; ++r)
                    for (int n = 0; n < 16; ++n)
                        for (int e = 0; e < 2; ++e)
                            o[r * 32 + n * 2 + e] = w[((4 * g + j) * 16 + n) * K + kb * 32 + 2 * r + e];
    }
}

#ifdef HAVE_AMX
struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static void linear_amx(const uint16_t* x, int64_t M, int64_t K, const uint16_t* wp, int64_t N, uint16_t* y,
                       int threads) {
    const int64_t NB = N / 16, KB = K / 32, groups = (NB + 3) / 4, MB = (M + 15) / 16;
    std::vector<uint16_t> padded;              // a tile loads 16 rows: the last ones read zeros, not past x
    if (M % 16) {
        padded.assign(MB * 16 * K, 0);
        std::memcpy(padded.data(), x, sizeof(uint16_t) * M * K);
        x = padded.data();
    }
#pragma omp parallel num_threads(std::min<int64_t>(threads, groups))
    {
        TileConfig cfg = {};
        cfg.palette = 1;
        for (int t = 0; t < 7; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
        _tile_loadconfig(&cfg);
        alignas(64) float c[4][256];
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t blocks = std::min<int64_t>(4, NB - 4 * g);
            for (int64_t rb = 0; rb < MB; ++rb) {     // the second pass over a group reads its weights from L2
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                const uint16_t* xr = x + rb * 16 * K;
                const uint16_t* b = wp + amx_offset(g, KB);
                for (int64_t kb = 0; kb < KB; ++kb, b += blocks * 512) {
                    _tile_loadd(4, xr + kb * 32, K * 2);
                    _tile_loadd(5, b, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    if (blocks > 1) { _tile_loadd(6, b + 512, 64); _tile_dpbf16ps(1, 4, 6); }
                    if (blocks > 2) { _tile_loadd(5, b + 1024, 64); _tile_dpbf16ps(2, 4, 5); }
                    if (blocks > 3) { _tile_loadd(6, b + 1536, 64); _tile_dpbf16ps(3, 4, 6); }
                }
                _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64);
                _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
                const int64_t rows = std::min<int64_t>(16, M - rb * 16);
                for (int64_t r = 0; r < rows; ++r)
                    for (int64_t j = 0; j < blocks; ++j)
                        for (int n = 0; n < 16; ++n)
                            store(y + (rb * 16 + r) * N + (4 * g + j) * 16 + n, c[j][r * 16 + n]);
            }
        }
        _tile_release();          // oneDNN's kernels set up their own tiles when they next run
    }
}

#endif

// ---- 3b. fp32 linears of a decode step's few rows, on AVX-512 or AVX2 with FMA ----
//
// y = x w^T + b. MKL's skinny fp32 matmul is compute-bound well before 32 rows; this one keeps R rows x 32
// outputs of sums in registers, and every weight is loaded once for R rows and every input once for 32
// outputs. The weights are laid out once (pack_f32) in groups of 32 outputs, a group's weights for one
// input next to each other: w[n][k] for the group's 32 n, then k + 1, ..., one stream the loop reads in
// order. Each output sums its products in input order, one multiply-add after another: the same order at
// every row count, every place of a row in the batch and either vector width, so a sequence's values do
// not depend on what shares its step. (MKL's order is its own, so not F.linear's values bit for bit;
// tests/test_cpu_kernels.py bounds the difference.) AVX-512 holds 12 rows x 32 outputs of sums in its 32
// registers, AVX2 3 rows in its 16: there oneDNN is faster from about a dozen rows on, and the engine
// hands it those steps (loading.f32_kernel_rows).
constexpr int F32_GROUP = 32;

static void pack_f32(const float* w, int64_t N, int64_t K, float* out) {
    for (int64_t n0 = 0; n0 < N; n0 += F32_GROUP) {
        const int64_t width = std::min<int64_t>(F32_GROUP, N - n0);
        for (int64_t k = 0; k < K; ++k)
            for (int64_t j = 0; j < width; ++j) *out++ = w[(n0 + j) * K + k];
    }
}

#if defined(__AVX512F__)
#define HAVE_F32_LINEARS 1
constexpr int LANES = 16;           // one vector of sums: 16 outputs
using vec = __m512;
static inline vec v_zero() { return _mm512_setzero_ps(); }
static inline vec v_load(const float* p) { return _mm512_loadu_ps(p); }
static inline vec v_set1(float x) { return _mm512_set1_ps(x); }
static inline vec v_fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec v_add(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline void v_store(float* p, vec v) { _mm512_storeu_ps(p, v); }
template <int C> constexpr int block_rows() { return 12; }    // 24 sums, 2 weight vectors, a broadcast input
#elif defined(__AVX2__) && defined(__FMA__)
#define HAVE_F32_LINEARS 1
constexpr int LANES = 8;
using vec = __m256;
static inline vec v_zero() { return _mm256_setzero_ps(); }
static inline vec v_load(const float* p) { return _mm256_loadu_ps(p); }
static inline vec v_set1(float x) { return _mm256_set1_ps(x); }
static inline vec v_fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec v_add(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline void v_store(float* p, vec v) { _mm256_storeu_ps(p, v); }
template <int C> constexpr int block_rows() { return C == 4 ? 3 : 6; }   // 12 sums + 4 weights + 1, of 16
#endif

#ifdef HAVE_F32_LINEARS
template <int R, int C>     // R rows x C vectors of outputs; wp: the group's weights, C * LANES a step of k
static void outer_block(const float* x, int64_t K, const float* wp, const float* bias, float* y, int64_t N) {
    vec acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = v_zero();
    for (int64_t k = 0; k < K; ++k, wp += LANES * C) {
        vec wv[C];
        for (int c = 0; c < C; ++c) wv[c] = v_load(wp + LANES * c);
        for (int r = 0; r < R; ++r) {
            const vec xv = v_set1(x[r * K + k]);
            for (int c = 0; c < C; ++c) acc[r][c] = v_fma(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
            v_store(y + r * N + LANES * c, bias ? v_add(acc[r][c], v_load(bias + LANES * c)) : acc[r][c]);
}

template <int C, int R = block_rows<C>()>     // r rows (r <= R) of one group of C vectors
static void outer_rows(int r, const float* x, int64_t K, const float* wp, const float* bias, float* y, int64_t N) {
    if constexpr (R > 1) if (r < R) return outer_rows<C, R - 1>(r, x, K, wp, bias, y, N);
    outer_block<R, C>(x, K, wp, bias, y, N);
}

static void skinny_linear_f32(const float* x, int64_t M, int64_t K, const float* wp, const float* bias, int64_t N,
                              float* y, int threads) {
    constexpr int FULL = F32_GROUP / LANES, HALF = 16 / LANES;    // a group's vectors; the last group's, N % 32 == 16
    const int64_t groups = (N + F32_GROUP - 1) / F32_GROUP;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; ++g) {              // each thread streams one stretch of the weights
        const int64_t n0 = g * F32_GROUP;
        const bool full = N - n0 >= F32_GROUP;
        const int64_t step = full ? block_rows<FULL>() : block_rows<HALF>();
        for (int64_t m0 = 0; m0 < M; m0 += step) {      // the next rows read the group's weights from L2
            const int r = int(std::min<int64_t>(step, M - m0));
            const float *xr = x + m0 * K, *wg = wp + n0 * K, *bg = bias ? bias + n0 : nullptr;
            if (full) outer_rows<FULL>(r, xr, K, wg, bg, y + m0 * N + n0, N);
            else outer_rows<HALF>(r, xr, K, wg, bg, y + m0 * N + n0, N);
        }
    }
}
#endif

// 1. decode attention, causal prefill attention, the KV write: a section of the CPU library, included once by cpu_kernels.cpp (one translation unit,
// so the sections' static functions inline into each other). See cpu_kernels.cpp for the whole map.
#pragma once
#include "common.h"

// ---- 1. decode attention ----
//
// One query token per sequence. Each (sequence, KV head) is one task: its group of query heads is
// scored against the sequence's cached keys block by block, softmaxed, and the values summed, all in
// fp32, with no gather copy, no padding and no mask. The kernel picks the cache's layout inside a block
// (engine/execution/backends.CpuAttention writes it):
//
//   key block:   (kv_heads, head_dim, block_size)   keys transposed: one head_dim step of a block's
//                                                    scores is one multiply-add of block_size lanes,
//                                                    no horizontal sums
//   value block: (kv_heads, block_size, head_dim)   a token's values are one row to add
//
//   q:            (n, heads, head_dim), row i at q + i * q_stride (a view of the fused q/k projection)
//   block_tables: (n, bt_stride) int64; context_lens: (n,) int64, tokens in the cache, this one included
//   out:          (n, heads, head_dim), contiguous
//
// Threads: OpenMP, the runtime torch has loaded (build.py links torch's own libgomp), so its threads are torch's.
// One block's step for the query heads of one KV head, in two forms:
//   scores: s[j][t] = q_j . k_t for the block's BS tokens (keys (D, BS)); s[j] at s + j * s_stride
//   values: acc_j += p_j[t] * v_t over its `valid` tokens (values (BS, D)); p_j at p + j * p_stride
// Both sum in the same order: four partial sums over head_dim for a score, even and odd tokens apart for
// the values.
//
// Portable: the block converted to fp32 once, then each head in turn.
template <typename T, int BS, int D>
static void scores_portable(const T* kb, const float* qf, int group, float* s, int64_t s_stride) {
    alignas(64) float f[D * BS];
#pragma omp simd
    for (int x = 0; x < D * BS; ++x) f[x] = to_float(kb[x]);
    for (int j = 0; j < group; ++j) {
        alignas(64) float sv[4][BS] = {};
        for (int d = 0; d < D; d += 4)
            for (int u = 0; u < 4; ++u) {
                const float qd = qf[j * D + d + u];
#pragma omp simd
                for (int o = 0; o < BS; ++o) sv[u][o] += qd * f[(d + u) * BS + o];
            }
#pragma omp simd
        for (int o = 0; o < BS; ++o) s[j * s_stride + o] = (sv[0][o] + sv[1][o]) + (sv[2][o] + sv[3][o]);
    }
}

template <typename T, int BS, int D>
static void values_portable(const T* vb, const float* p, int64_t p_stride, int valid, int group, float* acc) {
    alignas(64) float f[BS * D];
#pragma omp simd
    for (int x = 0; x < BS * D; ++x) f[x] = to_float(vb[x]);
    for (int j = 0; j < group; ++j) {
        alignas(64) float a[2][D] = {};
        const float* pj = p + j * p_stride;
        int o = 0;
        for (; o + 1 < valid; o += 2)
#pragma omp simd
            for (int d = 0; d < D; ++d) {
                a[0][d] += pj[o] * f[o * D + d];
                a[1][d] += pj[o + 1] * f[(o + 1) * D + d];
            }
        if (o < valid)
#pragma omp simd
            for (int d = 0; d < D; ++d) a[0][d] += pj[o] * f[o * D + d];
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[j * D + d] += a[0][d] + a[1][d];
    }
}

#ifdef __AVX512F__
// AVX-512: G heads at a time with every sum in a register; each 16 keys or values are loaded (and
// converted) once for all G heads instead of once into a buffer and again per head (the portable form
// beside it is the comparison in docs/results.md).
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) {        // 16 bf16 -> fp32: each the top half of a float
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

template <typename T, int BS, int D, int G>
static inline void scores_simd(const T* kb, const float* qf, float* s, int64_t s_stride) {
    constexpr int C = BS / 16;
    __m512 sv[G][4][C];
    for (int j = 0; j < G; ++j)
        for (int u = 0; u < 4; ++u)
            for (int c = 0; c < C; ++c) sv[j][u][c] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 4)
        for (int u = 0; u < 4; ++u)
            for (int c = 0; c < C; ++c) {
                const __m512 k = load16(kb + (d + u) * BS + 16 * c);
                for (int j = 0; j < G; ++j)
                    sv[j][u][c] = _mm512_fmadd_ps(_mm512_set1_ps(qf[j * D + d + u]), k, sv[j][u][c]);
            }
    for (int j = 0; j < G; ++j)
        for (int c = 0; c < C; ++c)
            _mm512_storeu_ps(s + j * s_stride + 16 * c, _mm512_add_ps(_mm512_add_ps(sv[j][0][c], sv[j][1][c]),
                                                                      _mm512_add_ps(sv[j][2][c], sv[j][3][c])));
}

template <typename T, int BS, int D, int G>
static inline void values_simd(const T* vb, const float* p, int64_t p_stride, int valid, float* acc) {
    constexpr int C = D / 16;
    __m512 a[2][G][C];
    for (int e = 0; e < 2; ++e)
        for (int j = 0; j < G; ++j)
            for (int c = 0; c < C; ++c) a[e][j][c] = _mm512_setzero_ps();
    for (int o = 0; o < valid; ++o)
        for (int c = 0; c < C; ++c) {
            const __m512 v = load16(vb + o * D + 16 * c);
            for (int j = 0; j < G; ++j)
                a[o & 1][j][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[j * p_stride + o]), v, a[o & 1][j][c]);
        }
    for (int j = 0; j < G; ++j)
        for (int c = 0; c < C; ++c) {
            float* r = acc + j * D + 16 * c;
            _mm512_storeu_ps(r, _mm512_add_ps(_mm512_loadu_ps(r), _mm512_add_ps(a[0][j][c], a[1][j][c])));
        }
}

// G heads at a time, G up to what fits the 32 vector registers: G * 4 * BS / 16 score sums or
// G * 2 * D / 16 value sums (3 for the default model's head_dim 64 in blocks of 16: its whole group)
template <int BS, int D>
constexpr int CHUNK = std::max(1, std::min(4, 28 / std::max(4 * BS / 16, 2 * D / 16)));

template <int BS, int D, typename F>
static inline void for_chunks(int group, F&& f) {       // f(std::integral_constant<int, G>, first head)
    constexpr int full = CHUNK<BS, D>;
    for (int j0 = 0; j0 < group; j0 += full) {
        const int g = std::min(full, group - j0);
        if (g == full) f(std::integral_constant<int, full>{}, j0);
        else if (g == 1) f(std::integral_constant<int, 1>{}, j0);
        else if constexpr (full > 2) {
            if (g == 2) f(std::integral_constant<int, 2>{}, j0);
            else if constexpr (full > 3) f(std::integral_constant<int, 3>{}, j0);
        }
    }
}
#endif

template <typename T, int BS, int D>
static inline void scores(const T* kb, const float* qf, int group, float* s, int64_t s_stride) {
#ifdef __AVX512F__
    for_chunks<BS, D>(group, [&](auto G, int j0) {
        scores_simd<T, BS, D, decltype(G)::value>(kb, qf + j0 * D, s + j0 * s_stride, s_stride);
    });
#else
    scores_portable<T, BS, D>(kb, qf, group, s, s_stride);
#endif
}

template <typename T, int BS, int D>
static inline void values(const T* vb, const float* p, int64_t p_stride, int valid, int group, float* acc) {
#ifdef __AVX512F__
    for_chunks<BS, D>(group, [&](auto G, int j0) {
        values_simd<T, BS, D, decltype(G)::value>(vb, p + j0 * p_stride, p_stride, valid, acc + j0 * D);
    });
#else
    values_portable<T, BS, D>(vb, p, p_stride, valid, group, acc);
#endif
}

// One (BS, D) pair per instantiation: a block's scores (BS lanes) and a head's accumulator (D lanes) live
// in registers. engine/kernels/cpu_kernels.SHAPES lists the pairs; other shapes take the portable path.
template <typename T, int BS, int D>
static void decode(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                   int64_t bt_stride, const int64_t* context_lens, T* out, int n, int heads, int kv_heads,
                   float scale, int threads) {
    const int group = heads / kv_heads;
    const int64_t block_stride = int64_t(kv_heads) * D * BS;         // one block of one layer, K or V
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int task = 0; task < n * kv_heads; ++task) {
        const int i = task / kv_heads, h = task % kv_heads;
        const int64_t ctx = context_lens[i], num_blocks = (ctx + BS - 1) / BS, row = num_blocks * BS;
        const int64_t* table = block_tables + i * bt_stride;
        thread_local std::vector<float> qf, acc, s;                   // a thread's, reused task after task
        qf.resize(size_t(group) * D);
        acc.assign(size_t(group) * D, 0.f);
        s.resize(size_t(group) * row);
        for (int j = 0; j < group; ++j)
            for (int d = 0; d < D; ++d)
                qf[j * D + d] = to_float(q[i * q_stride + int64_t(h * group + j) * D + d]) * scale;
        const auto key = [&](int64_t b) { return k_cache + table[b] * block_stride + int64_t(h) * D * BS; };
        const auto value = [&](int64_t b) { return v_cache + table[b] * block_stride + int64_t(h) * BS * D; };

        for (int64_t b = 0; b < num_blocks; ++b) {                    // scores, a block at a time
            if (b + 1 < num_blocks) prefetch<3>(key(b + 1), D * BS);
            if (b + AHEAD < num_blocks) prefetch<2>(key(b + AHEAD), D * BS);
            scores<T, BS, D>(key(b), qf.data(), group, &s[b * BS], row);
        }
        // softmax per query head over its ctx scores (the last block's tail beyond ctx is not read)
        for (int j = 0; j < group; ++j) {
            float* sj = &s[j * row];
            const float m = max_of(sj, ctx);
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < ctx; ++t) {
                sj[t] = std::exp(sj[t] - m);
                sum += sj[t];
            }
            const float inv = 1.f / sum;
#pragma omp simd
            for (int64_t t = 0; t < ctx; ++t) sj[t] *= inv;
        }
        for (int64_t b = 0; b < num_blocks; ++b) {                    // values, a block at a time
            if (b + 1 < num_blocks) prefetch<3>(value(b + 1), BS * D);
            if (b + AHEAD < num_blocks) prefetch<2>(value(b + AHEAD), BS * D);
            values<T, BS, D>(value(b), &s[b * BS], row, int(std::min<int64_t>(BS, ctx - b * BS)), group, acc.data());
        }
        for (int j = 0; j < group; ++j)
            for (int d = 0; d < D; ++d)
                store(&out[(int64_t(i) * heads + h * group + j) * D + d], acc[j * D + d]);
    }
}

// (block_size, head_dim) -> its instantiation; 0 when there is none (engine/kernels/cpu_kernels.SHAPES)
template <typename T>
static int dispatch(const T* q, int64_t q_stride, const T* k, const T* v, const int64_t* tables, int64_t bt_stride,
                    const int64_t* lens, T* out, int n, int heads, int kv_heads, int head_dim, int block_size,
                    float scale, int threads) {
#define SHAPE(BS, D)                                                                                        \
    if (block_size == BS && head_dim == D) {                                                                \
        decode<T, BS, D>(q, q_stride, k, v, tables, bt_stride, lens, out, n, heads, kv_heads, scale, threads); \
        return 1;                                                                                            \
    }
    SHAPE(16, 64) SHAPE(16, 128) SHAPE(32, 64) SHAPE(32, 128)
#undef SHAPE
    return 0;
}

// Causal attention of fresh prompt chunks (AVX-512), fp32 or bf16 (computed in fp32, the output rounded
// once): m sequences' first L tokens each, side by side
// (models' q, k, v rows: token t of sequence s at row s * L + t, a row's heads at stride D). One task is
// one (sequence, KV head). Its keys are laid out once in blocks of 32, each block (D, 32), so that 16
// keys' scores are one vector multiply-add per dimension over 8 KB that stay in L1. Then each of its
// query heads, R rows at a time: their scores against the keys up to their last row, a softmax per row
// over all its scores at once (fp32, exact, as SDPA's math), and the values' sum with R x 64 sums in
// registers. SDPA's values up to rounding, in fewer passes over the keys (docs/results.md).
#ifdef __AVX512F__
constexpr int CAUSAL_R = 6;

template <typename T, int D>
static void causal(const T* q, int64_t q_stride, const T* k, int64_t k_stride, const T* v, int64_t v_stride, T* out,
                   int m, int L, int heads, int kv_heads, float scale, int threads) {
    const int group = heads / kv_heads, Lp = (L + 31) / 32 * 32;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int task = 0; task < m * kv_heads; ++task) {
        const int s = task / kv_heads, g = task % kv_heads;
        thread_local std::vector<float> kt, sc;
        kt.assign(size_t(D) * Lp, 0.f);                               // keys past L are zeros
        sc.resize(size_t(CAUSAL_R) * Lp);
        for (int t = 0; t < L; ++t) {
            const T* kr = k + (int64_t(s) * L + t) * k_stride + g * D;
            float* block = &kt[size_t(t / 32) * D * 32 + t % 32];
            for (int d = 0; d < D; ++d) block[d * 32] = to_float(kr[d]);
        }
        for (int j = 0; j < group; ++j) {
            const int h = g * group + j;
            for (int i0 = 0; i0 < L; i0 += CAUSAL_R) {
                const int R = std::min(CAUSAL_R, L - i0), n = i0 + R;   // rows i0 .. i0 + R - 1 see keys < n
                alignas(64) float qf[CAUSAL_R][D];   // the rows' queries in fp32, once, not again for every key block
                for (int r = 0; r < CAUSAL_R; ++r) {
                    const T* qr = q + (int64_t(s) * L + i0 + std::min(r, R - 1)) * q_stride + h * D;
                    for (int d = 0; d < D; ++d) qf[r][d] = to_float(qr[d]);
                }
                for (int t0 = 0; t0 < n; t0 += 32) {                   // scores, a block of 32 keys at a time
                    const float* block = &kt[size_t(t0 / 32) * D * 32];
                    __m512 a[CAUSAL_R][2];
                    for (int r = 0; r < CAUSAL_R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
                    for (int d = 0; d < D; ++d) {
                        const __m512 k0 = _mm512_loadu_ps(block + d * 32), k1 = _mm512_loadu_ps(block + d * 32 + 16);
                        for (int r = 0; r < CAUSAL_R; ++r) {
                            const __m512 qd = _mm512_set1_ps(qf[r][d]);
                            a[r][0] = _mm512_fmadd_ps(qd, k0, a[r][0]);
                            a[r][1] = _mm512_fmadd_ps(qd, k1, a[r][1]);
                        }
                    }
                    for (int r = 0; r < CAUSAL_R; ++r) {
                        _mm512_storeu_ps(&sc[size_t(r) * Lp + t0], a[r][0]);
                        _mm512_storeu_ps(&sc[size_t(r) * Lp + t0 + 16], a[r][1]);
                    }
                }
                float inv[CAUSAL_R];
                for (int r = 0; r < R; ++r) {                          // softmax of row i0 + r over keys 0 .. i0 + r
                    float* sr = &sc[size_t(r) * Lp];
                    const int valid = i0 + r + 1;
                    const float mx = max_of(sr, valid) * scale;      // (scale > 0: the largest scaled score)
                    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                    for (int t = 0; t < valid; ++t) {
                        sr[t] = std::exp(sr[t] * scale - mx);
                        sum += sr[t];
                    }
                    for (int t = valid; t < n; ++t) sr[t] = 0.f;         // the causal mask
                    inv[r] = 1.f / sum;
                }
                for (int d0 = 0; d0 < D; d0 += 64) {                   // values, 64 dimensions at a time
                    __m512 a[CAUSAL_R][4];
                    for (int r = 0; r < CAUSAL_R; ++r)
                        for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_ps();
                    for (int t = 0; t < n; ++t) {
                        const T* vt = v + (int64_t(s) * L + t) * v_stride + g * D + d0;
                        __m512 vv[4];
                        for (int c = 0; c < 4; ++c) vv[c] = load16(vt + 16 * c);
                        for (int r = 0; r < CAUSAL_R; ++r) {
                            const __m512 p = _mm512_set1_ps(sc[size_t(r) * Lp + t]);
                            for (int c = 0; c < 4; ++c) a[r][c] = _mm512_fmadd_ps(p, vv[c], a[r][c]);
                        }
                    }
                    for (int r = 0; r < R; ++r)
                        for (int c = 0; c < 4; ++c) {
                            alignas(64) float o[16];
                            _mm512_store_ps(o, _mm512_mul_ps(a[r][c], _mm512_set1_ps(inv[r])));
                            T* dst = out + ((int64_t(s) * L + i0 + r) * heads + h) * D + d0 + 16 * c;
                            for (int e = 0; e < 16; ++e) store(dst + e, o[e]);
                        }
                }
            }
        }
    }
}
#endif

// A step's new keys and values into their slots, in the layout above. k, v: (tokens, kv_heads, D), rows at
// k + t * k_stride (views of the fused projection); slots: (tokens,) int64. T is copied, never converted.
template <typename T>
static void write_kv(const T* k, int64_t k_stride, const T* v, int64_t v_stride, T* k_cache, T* v_cache,
                     const int64_t* slots, int64_t tokens, int kv_heads, int D, int bs, int threads) {
    const int64_t block_stride = int64_t(kv_heads) * D * bs;
#pragma omp parallel for num_threads(threads) if (tokens >= 256)
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t block = slots[t] / bs, off = slots[t] % bs;
        for (int h = 0; h < kv_heads; ++h) {
            const T* kr = k + t * k_stride + int64_t(h) * D;
            const T* vr = v + t * v_stride + int64_t(h) * D;
            T* kb = k_cache + block * block_stride + int64_t(h) * D * bs + off;      // (D, bs): stride bs
            T* vb = v_cache + block * block_stride + (int64_t(h) * bs + off) * D;    // (bs, D): one row
            for (int d = 0; d < D; ++d) kb[int64_t(d) * bs] = kr[d];
            std::memcpy(vb, vr, sizeof(T) * D);
        }
    }
}

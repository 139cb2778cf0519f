// The CPU's own kernels (engine/kernels/build.py builds this file once per machine; engine/kernels/ops.py checks
// every argument before it calls these functions through ctypes, so nothing here checks bounds again):
//   1. decode attention over the paged KV cache, read where it lies;
//   2. the model's elementwise chains, each one pass over its rows (torch runs them as 2 to 9 ops,
//      each a pass over memory), in bf16 rounding where torch's ops round, so the values are torch's
//      up to the last bit of an fp32 exp or rsqrt; and in fp32;
//   3. linears of a decode step's few rows: bf16 on AMX tiles, where the CPU and the OS have them
//      (3a), fp32 on AVX-512 (3b);
//   4. a decode step's layers in one call of the kernels above.
//
// ---- 1. decode attention ----
//
// One query token per sequence. Each (sequence, KV head) is one task: its group of query heads is
// scored against the sequence's cached keys block by block, softmaxed, and the values summed, all in
// fp32, with no gather copy, no padding and no mask. The kernel picks the cache's layout inside a block
// (engine/attention.CpuAttention writes it):
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
#if defined(__AVX512F__) || (defined(__AMX_TILE__) && defined(__AMX_BF16__))
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

// The next blocks are elsewhere in memory: ask for them while this one is computed (blocks are a few KB,
// too short for the hardware prefetcher to find on its own; without this the kernel waits on memory).
// The next one into L1; the one AHEAD blocks on into L2, so that memory's latency is hidden too.
constexpr int AHEAD = 4;
template <int LEVEL, typename T>
static inline void prefetch(const T* p, int count) {
    for (int64_t x = 0; x < int64_t(count) * int64_t(sizeof(T)); x += 64)
        __builtin_prefetch((const char*)p + x, 0, LEVEL);
}

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
            float m = sj[0], sum = 0.f;
            for (int64_t t = 1; t < ctx; ++t) m = std::max(m, sj[t]);
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
                const T* qr[CAUSAL_R];
                for (int r = 0; r < CAUSAL_R; ++r) qr[r] = q + (int64_t(s) * L + i0 + std::min(r, R - 1)) * q_stride + h * D;
                for (int t0 = 0; t0 < n; t0 += 32) {                   // scores, a block of 32 keys at a time
                    const float* block = &kt[size_t(t0 / 32) * D * 32];
                    __m512 a[CAUSAL_R][2];
                    for (int r = 0; r < CAUSAL_R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
                    for (int d = 0; d < D; ++d) {
                        const __m512 k0 = _mm512_loadu_ps(block + d * 32), k1 = _mm512_loadu_ps(block + d * 32 + 16);
                        for (int r = 0; r < CAUSAL_R; ++r) {
                            const __m512 qd = _mm512_set1_ps(to_float(qr[r][d]));
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
                    float mx = sr[0] * scale, sum = 0.f;
                    for (int t = 1; t < valid; ++t) mx = std::max(mx, sr[t] * scale);
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
// use, and are rounded to bf16 once at the end: bit for bit F.linear's values at these row counts
// (checked on a probe when a model is packed, engine/models/linears.amx_linears_work). Threads take
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

// ---- 3b. fp32 linears of a decode step's few rows on AVX-512 ----
//
// y = x w^T + b for 1 to 32 rows. MKL's skinny fp32 matmul is compute-bound well before that here;
// this one keeps R x 2 vectors of sums in registers (R rows, 32 outputs), and every weight is loaded
// once for R rows and every input once for 32 outputs. The weights are laid out once (pack_f32) in
// groups of 32 outputs, a group's weights for one input next to each other: w[n][k] for the group's 32
// n, then k + 1, ..., one stream the loop reads in order. Each output sums its products in input
// order, one multiply-add after another: the same order at every row count and every place of a row
// in the batch, so a sequence's values do not depend on what shares its step. (MKL's order is its
// own, so not F.linear's values bit for bit; tests/test_cpu_kernels.py bounds the difference.)
constexpr int F32_GROUP = 32;

static void pack_f32(const float* w, int64_t N, int64_t K, float* out) {
    for (int64_t n0 = 0; n0 < N; n0 += F32_GROUP) {
        const int64_t width = std::min<int64_t>(F32_GROUP, N - n0);
        for (int64_t k = 0; k < K; ++k)
            for (int64_t j = 0; j < width; ++j) *out++ = w[(n0 + j) * K + k];
    }
}

#ifdef __AVX512F__
template <int R, int C>     // R rows x C vectors of 16 outputs; wp: the group's weights, C * 16 a step of k
static void outer_block(const float* x, int64_t K, const float* wp, const float* bias, float* y, int64_t N) {
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k, wp += 16 * C) {
        __m512 wv[C];
        for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_ps(wp + 16 * c);
        for (int r = 0; r < R; ++r) {
            const __m512 xv = _mm512_set1_ps(x[r * K + k]);
            for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
            _mm512_storeu_ps(y + r * N + 16 * c, bias ? _mm512_add_ps(acc[r][c], _mm512_loadu_ps(bias + 16 * c)) : acc[r][c]);
}

constexpr int F32_R = 12;          // 24 sums in registers, 2 weight vectors and a broadcast input beside them

template <int R = F32_R>
static void outer_rows(int r, int c, const float* x, int64_t K, const float* wp, const float* bias, float* y, int64_t N) {
    if constexpr (R > 1) if (r < R) return outer_rows<R - 1>(r, c, x, K, wp, bias, y, N);
    if (c == 2) outer_block<R, 2>(x, K, wp, bias, y, N);
    else outer_block<R, 1>(x, K, wp, bias, y, N);
}

static void skinny_linear_f32(const float* x, int64_t M, int64_t K, const float* wp, const float* bias, int64_t N,
                              float* y, int threads) {
    const int64_t groups = (N + F32_GROUP - 1) / F32_GROUP;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; ++g) {              // each thread streams one stretch of the weights
        const int64_t n0 = g * F32_GROUP;
        const int c = int(std::min<int64_t>(F32_GROUP, N - n0) / 16);
        for (int64_t m0 = 0; m0 < M; m0 += F32_R)       // the next rows read the group's weights from L2
            outer_rows(int(std::min<int64_t>(F32_R, M - m0)), c, x + m0 * K, K, wp + n0 * K, bias ? bias + n0 : nullptr,
                       y + m0 * N + n0, N);
    }
}
#endif

// ---- 4. a decode step's layers in one call (Llama-shaped; bf16 on AMX, fp32 on AVX-512) ----
//
// The same kernels in the same order as the model's layer-by-layer forward (models.llama.DecoderLayer with
// CpuAttention, for a decode-only step of few sequences), so the same values bit for bit; what it saves is
// the Python between them, about ten calls and their tensors per layer, during which the other threads
// wait (docs/results.md). x: the embeddings in, the last layer's output out;
// residual: the residual stream out (the final norm adds it, in Python).
struct LayerWeights {                 // engine/kernels/ops.py builds it per call from the layers' tensors
    const void *in_norm, *qkv, *o, *post_norm, *gate_up, *down;   // the linears in their kernel's layout
    void *k_cache, *v_cache;
};

#ifdef HAVE_AMX
static void linear_rows(const uint16_t* x, int64_t M, int64_t K, const void* w, int64_t N, uint16_t* y, int threads) {
    linear_amx(x, M, K, (const uint16_t*)w, N, y, threads);
}
#endif
#ifdef __AVX512F__
static void linear_rows(const float* x, int64_t M, int64_t K, const void* w, int64_t N, float* y, int threads) {
    skinny_linear_f32(x, M, K, (const float*)w, nullptr, N, y, threads);
}

template <typename T>
static void decode_layers(const LayerWeights* layers, int num_layers, T* x, T* residual, int64_t M, int hidden,
                          int heads, int kv_heads, int D, int inter, int block_size, const T* cos, const T* sin,
                          const int64_t* slots, const int64_t* tables, int64_t bt_stride, const int64_t* ctx_lens,
                          float eps, float scale, int threads) {
    const int qkv_width = (heads + 2 * kv_heads) * D, qk_width = (heads + kv_heads) * D;
    std::vector<T> h(M * hidden), qkv(M * qkv_width), qk(M * qk_width), attn(M * heads * D), o(M * hidden),
        gate_up(M * 2 * inter), act(M * inter);
    for (int l = 0; l < num_layers; ++l) {
        const LayerWeights& w = layers[l];
        const T *in_norm = (const T*)w.in_norm, *post_norm = (const T*)w.post_norm;
        T *k_cache = (T*)w.k_cache, *v_cache = (T*)w.v_cache;
        if (l == 0) {
            std::memcpy(residual, x, sizeof(T) * M * hidden);
            rms_norm_rows(x, nullptr, in_norm, h.data(), nullptr, M, hidden, eps, threads);
        } else {
            rms_norm_rows(x, residual, in_norm, h.data(), residual, M, hidden, eps, threads);
        }
        linear_rows(h.data(), M, hidden, w.qkv, qkv_width, qkv.data(), threads);
        rope_rows(qkv.data(), qkv_width, cos, sin, qk.data(), M, heads + kv_heads, D, threads);
        write_kv(qk.data() + heads * D, qk_width, qkv.data() + qk_width, qkv_width, k_cache, v_cache, slots, M,
                 kv_heads, D, block_size, threads);
        dispatch(qk.data(), qk_width, (const T*)k_cache, (const T*)v_cache, tables, bt_stride, ctx_lens, attn.data(),
                 int(M), heads, kv_heads, D, block_size, scale, threads);
        linear_rows(attn.data(), M, heads * D, w.o, hidden, o.data(), threads);
        rms_norm_rows(o.data(), residual, post_norm, h.data(), residual, M, hidden, eps, threads);
        linear_rows(h.data(), M, hidden, w.gate_up, 2 * inter, gate_up.data(), threads);
        silu_and_mul_rows(gate_up.data(), act.data(), M, inter, threads);
        linear_rows(act.data(), M, inter, w.down, hidden, x, threads);
    }
}
#endif

static bool layer_shapes(int hidden, int heads, int head_dim, int inter, int block_size) {
    return hidden % 32 == 0 && (heads * head_dim) % 32 == 0 && inter % 32 == 0 && head_dim % 16 == 0 &&
           (block_size == 16 || block_size == 32) && (head_dim == 64 || head_dim == 128);
}

// head_dim -> its instantiation; 0 where there is none (or no AVX-512)
template <typename T>
static int causal_prefill(const T* q, int64_t q_stride, const T* k, int64_t k_stride, const T* v, int64_t v_stride,
                          T* out, int m, int L, int heads, int kv_heads, int head_dim, float scale, int threads) {
#ifdef __AVX512F__
    if (head_dim == 64) causal<T, 64>(q, q_stride, k, k_stride, v, v_stride, out, m, L, heads, kv_heads, scale, threads);
    else if (head_dim == 128) causal<T, 128>(q, q_stride, k, k_stride, v, v_stride, out, m, L, heads, kv_heads, scale, threads);
    else return 0;
    return 1;
#else
    return 0;
#endif
}
extern "C" {
int paged_decode_f32(const float* q, int64_t q_stride, const float* k, const float* v, const int64_t* tables,
                      int64_t bt_stride, const int64_t* lens, float* out, int n, int heads, int kv_heads,
                      int head_dim, int block_size, float scale, int threads) {
    return dispatch(q, q_stride, k, v, tables, bt_stride, lens, out, n, heads, kv_heads, head_dim, block_size, scale, threads);
}
int paged_decode_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k, const uint16_t* v,
                       const int64_t* tables, int64_t bt_stride, const int64_t* lens, uint16_t* out, int n,
                       int heads, int kv_heads, int head_dim, int block_size, float scale, int threads) {
    return dispatch(q, q_stride, k, v, tables, bt_stride, lens, out, n, heads, kv_heads, head_dim, block_size, scale, threads);
}
void rms_norm_bf16(const uint16_t* x, const uint16_t* residual, const uint16_t* w, uint16_t* out, uint16_t* sum_out,
                   int64_t rows, int hidden, float eps, int threads) {
    rms_norm_rows(x, residual, w, out, sum_out, rows, hidden, eps, threads);
}
void silu_and_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int inter, int threads) {
    silu_and_mul_rows(gate_up, out, rows, inter, threads);
}
void rope_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* cos, const uint16_t* sin, uint16_t* out,
               int64_t rows, int heads, int head_dim, int threads) {
    rope_rows(x, x_stride, cos, sin, out, rows, heads, head_dim, threads);
}
void write_kv_16(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride, uint16_t* k_cache,
                 uint16_t* v_cache, const int64_t* slots, int64_t tokens, int kv_heads, int head_dim, int block_size,
                 int threads) {
    write_kv(k, k_stride, v, v_stride, k_cache, v_cache, slots, tokens, kv_heads, head_dim, block_size, threads);
}
void write_kv_32(const uint32_t* k, int64_t k_stride, const uint32_t* v, int64_t v_stride, uint32_t* k_cache,
                 uint32_t* v_cache, const int64_t* slots, int64_t tokens, int kv_heads, int head_dim, int block_size,
                 int threads) {
    write_kv(k, k_stride, v, v_stride, k_cache, v_cache, slots, tokens, kv_heads, head_dim, block_size, threads);
}
// AMX: whether this build has it and the OS lets this process use the tiles (asked once per process:
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); without it the functions below are never called
int amx_bf16_ready() {
#ifdef HAVE_AMX
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return 0;
#endif
}
// whether this build has the AVX-512 kernels (the fp32 linears, causal prefill, decode_layers in fp32)
int has_avx512() {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}
// w: (N, K) bf16, N a multiple of 16 and K of 32 -> out: N * K bf16 in the tile layout above
void pack_amx_bf16(const uint16_t* w, int64_t N, int64_t K, uint16_t* out) { pack_amx(w, N, K, out); }
// x: (M, K) contiguous, wp: pack_amx_bf16's, y: (M, N) -> 1, or 0 where this build has no AMX
int linear_amx_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* wp, int64_t N, uint16_t* y, int threads) {
#ifdef HAVE_AMX
    linear_amx(x, M, K, wp, N, y, threads);
    return 1;
#else
    return 0;
#endif
}
// w: (N, K) fp32, N a multiple of 16 -> out: N * K fp32 in the layout of section 3b
void pack_f32_weights(const float* w, int64_t N, int64_t K, float* out) { pack_f32(w, N, K, out); }
// x: (M, K), wp: pack_f32_weights', bias: (N,) or null, y: (M, N), fp32, contiguous -> 1, or 0 without AVX-512
int linear_f32(const float* x, int64_t M, int64_t K, const float* wp, const float* bias, int64_t N, float* y,
               int threads) {
#ifdef __AVX512F__
    skinny_linear_f32(x, M, K, wp, bias, N, y, threads);
    return 1;
#else
    return 0;
#endif
}
// a decode step's layers (section 4) -> 1, or 0 where this build has not the kernels or the shapes have none
int decode_layers_bf16(const LayerWeights* layers, int num_layers, uint16_t* x, uint16_t* residual, int64_t M,
                       int hidden, int heads, int kv_heads, int head_dim, int inter, int block_size,
                       const uint16_t* cos, const uint16_t* sin, const int64_t* slots, const int64_t* tables,
                       int64_t bt_stride, const int64_t* ctx_lens, float eps, float scale, int threads) {
#ifdef HAVE_AMX
    if (!layer_shapes(hidden, heads, head_dim, inter, block_size)) return 0;
    decode_layers(layers, num_layers, x, residual, M, hidden, heads, kv_heads, head_dim, inter, block_size, cos, sin,
                  slots, tables, bt_stride, ctx_lens, eps, scale, threads);
    return 1;
#else
    return 0;
#endif
}
int decode_layers_f32(const LayerWeights* layers, int num_layers, float* x, float* residual, int64_t M, int hidden,
                      int heads, int kv_heads, int head_dim, int inter, int block_size, const float* cos,
                      const float* sin, const int64_t* slots, const int64_t* tables, int64_t bt_stride,
                      const int64_t* ctx_lens, float eps, float scale, int threads) {
#ifdef __AVX512F__
    if (!layer_shapes(hidden, heads, head_dim, inter, block_size)) return 0;
    decode_layers(layers, num_layers, x, residual, M, hidden, heads, kv_heads, head_dim, inter, block_size, cos, sin,
                  slots, tables, bt_stride, ctx_lens, eps, scale, threads);
    return 1;
#else
    return 0;
#endif
}
// fresh prompt chunks' causal attention (section 1) -> 1, or 0 without AVX-512 or a kernel for head_dim
int causal_prefill_f32(const float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                       int64_t v_stride, float* out, int m, int L, int heads, int kv_heads, int head_dim, float scale,
                       int threads) {
    return causal_prefill(q, q_stride, k, k_stride, v, v_stride, out, m, L, heads, kv_heads, head_dim, scale, threads);
}
int causal_prefill_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride, const uint16_t* v,
                        int64_t v_stride, uint16_t* out, int m, int L, int heads, int kv_heads, int head_dim,
                        float scale, int threads) {
    return causal_prefill(q, q_stride, k, k_stride, v, v_stride, out, m, L, heads, kv_heads, head_dim, scale, threads);
}
void rms_norm_f32(const float* x, const float* residual, const float* w, float* out, float* sum_out, int64_t rows,
                  int hidden, float eps, int threads) {
    rms_norm_rows(x, residual, w, out, sum_out, rows, hidden, eps, threads);
}
void silu_and_mul_f32(const float* gate_up, float* out, int64_t rows, int inter, int threads) {
    silu_and_mul_rows(gate_up, out, rows, inter, threads);
}
void rope_f32(const float* x, int64_t x_stride, const float* cos, const float* sin, float* out, int64_t rows,
              int heads, int head_dim, int threads) {
    rope_rows(x, x_stride, cos, sin, out, rows, heads, head_dim, threads);
}
}

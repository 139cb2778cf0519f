// The CPU's own kernels (engine/kernels/build.py builds this file once per machine; engine/kernels/ops.py checks
// every argument before it calls these functions through ctypes, so nothing here checks bounds again):
//   1. decode attention over the paged KV cache, read where it lies;
//   2. the model's elementwise chains, each one pass over its rows (torch runs them as 2 to 9 ops,
//      each a pass over memory), in bf16 rounding where torch's ops round, so the values are torch's
//      up to the last bit of an fp32 exp or rsqrt; and in fp32;
//   3. linears of a decode step's few rows: bf16 on AMX tiles, where the CPU and the OS have them
//      (3a), fp32 on AVX-512 or AVX2 with FMA (3b);
//   4. a decode step's layers in one call of the kernels above.
//
// One section a file, all compiled as this one translation unit: common.h (headers, bf16 <-> fp32,
// prefetch), attention.h (1), chains.h (2), linears.h (3a, 3b), layers.h (4). This file holds the
// C entry points that engine/kernels/ops.py calls.
//
#include "attention.h"
#include "chains.h"
#include "linears.h"
#include "layers.h"

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
// whether this build has the AVX-512 kernels (causal prefill; the fp32 linears' widest form)
int has_avx512() {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}
// whether this build has the fp32 linears (AVX-512, or AVX2 with FMA) and so decode_layers in fp32
int has_f32_linears() {
#ifdef HAVE_F32_LINEARS
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
// x: (M, K), wp: pack_f32_weights', bias: (N,) or null, y: (M, N), fp32, contiguous -> 1, or 0 where this
// build has not the fp32 linears
int linear_f32(const float* x, int64_t M, int64_t K, const float* wp, const float* bias, int64_t N, float* y,
               int threads) {
#ifdef HAVE_F32_LINEARS
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
#ifdef HAVE_F32_LINEARS
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

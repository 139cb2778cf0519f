// 4. a decode step's layers in one call: a section of the CPU library, included once by cpu_kernels.cpp (one translation unit,
// so the sections' static functions inline into each other). See cpu_kernels.cpp for the whole map.
#pragma once
#include "attention.h"
#include "chains.h"
#include "linears.h"

// ---- 4. a decode step's layers in one call (Llama-shaped; bf16 on AMX, fp32 on AVX-512 or AVX2) ----
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
#ifdef HAVE_F32_LINEARS
static void linear_rows(const float* x, int64_t M, int64_t K, const void* w, int64_t N, float* y, int threads) {
    skinny_linear_f32(x, M, K, (const float*)w, nullptr, N, y, threads);
}
#endif
#if defined(HAVE_AMX) || defined(HAVE_F32_LINEARS)

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

// Paged-attention decode: one query token per sequence attends to its sequence's
// keys/values, read from a blocked KV cache through the sequence's block table
// (zserve's decode step; the torch reference is zserve.model.attention).
//
//   out           fp32  [num_seqs, num_heads, head_dim]
//   q             fp32  [num_seqs, num_heads, head_dim]
//   k_cache       KV    [num_blocks, block_size, num_kv_heads, head_dim]
//   v_cache       KV    [num_blocks, block_size, num_kv_heads, head_dim]
//   block_tables  int32 [num_seqs, max_blocks]  physical block of positions [b*block_size, ...)
//   context_lens  int32 [num_seqs]              keys the query attends to (positions 0..len-1)
//
// KV is fp32 (paged_attention_decode_f32), fp16 bits (_f16) or bfloat16 bits (_bf16),
// passed as 16-bit integers; scores, softmax and the weighted sum accumulate in fp32.
// Grouped-query attention: query head h reads KV head h / (num_heads / num_kv_heads).
//
// Launch: grid (num_heads, num_seqs), block (PA_THREADS). Each warp walks every
// PA_WARPS-th key with an online softmax (running max m, sum l, accumulator acc over
// head_dim spread across lanes); the warps' partial results are merged in shared
// memory at the end. head_dim <= PA_MAX_HEAD_DIM.
//
// No headers: compiles with plain NVRTC for any sm_XX.

#define PA_WARPS 4
#define PA_THREADS (PA_WARPS * 32)
#define PA_MAX_HEAD_DIM 256
#define PA_PER_LANE (PA_MAX_HEAD_DIM / 32)
#define PA_NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float kv_to_float(float x) { return x; }

// bfloat16 is the top half of an fp32: widening is a shift, exact.
struct bf16_bits { unsigned short v; };
__device__ __forceinline__ float kv_to_float(bf16_bits x) {
    return __uint_as_float(static_cast<unsigned int>(x.v) << 16);
}

struct f16_bits { unsigned short v; };
__device__ __forceinline__ float kv_to_float(f16_bits x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.v));
    return f;
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        x += __shfl_xor_sync(0xffffffffu, x, offset);
    }
    return x;
}

template <typename KV>
__device__ void paged_attention_decode(
    float* __restrict__ out,
    const float* __restrict__ q,
    const KV* __restrict__ k_cache,
    const KV* __restrict__ v_cache,
    const int* __restrict__ block_tables,
    const int* __restrict__ context_lens,
    float scale,
    int num_heads,
    int num_kv_heads,
    int head_dim,
    int block_size,
    int max_blocks) {
    __shared__ float q_s[PA_MAX_HEAD_DIM];
    __shared__ float warp_m[PA_WARPS];
    __shared__ float warp_l[PA_WARPS];
    __shared__ float warp_acc[PA_WARPS][PA_MAX_HEAD_DIM];

    const int head = blockIdx.x;
    const int seq = blockIdx.y;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int kv_head = head / (num_heads / num_kv_heads);
    const int context_len = context_lens[seq];
    const long long q_base = (static_cast<long long>(seq) * num_heads + head) * head_dim;

    for (int i = threadIdx.x; i < head_dim; i += PA_THREADS) {
        q_s[i] = q[q_base + i];
    }
    __syncthreads();

    float m = PA_NEG_INF;
    float l = 0.0f;
    float acc[PA_PER_LANE];
#pragma unroll
    for (int j = 0; j < PA_PER_LANE; ++j) acc[j] = 0.0f;

    const int* table = block_tables + static_cast<long long>(seq) * max_blocks;
    for (int t = warp; t < context_len; t += PA_WARPS) {
        const long long block = table[t / block_size];
        const long long slot = block * block_size + t % block_size;
        const long long base = (slot * num_kv_heads + kv_head) * head_dim;
        float partial = 0.0f;
        for (int i = lane; i < head_dim; i += 32) {
            partial += q_s[i] * kv_to_float(k_cache[base + i]);
        }
        const float s = warp_sum(partial) * scale;
        const float m_new = fmaxf(m, s);
        const float correction = expf(m - m_new);  // 0 on the first key (m = -inf)
        const float p = expf(s - m_new);
        l = l * correction + p;
#pragma unroll
        for (int j = 0; j < PA_PER_LANE; ++j) {
            const int i = lane + 32 * j;
            if (i < head_dim) {
                acc[j] = acc[j] * correction + p * kv_to_float(v_cache[base + i]);
            }
        }
        m = m_new;
    }

    if (lane == 0) {
        warp_m[warp] = m;
        warp_l[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < PA_PER_LANE; ++j) {
        const int i = lane + 32 * j;
        if (i < head_dim) warp_acc[warp][i] = acc[j];
    }
    __syncthreads();

    // Merge the warps' softmax partials: rescale each to the global max.
    float m_all = PA_NEG_INF;
#pragma unroll
    for (int w = 0; w < PA_WARPS; ++w) m_all = fmaxf(m_all, warp_m[w]);
    float weights[PA_WARPS];
    float l_all = 0.0f;
#pragma unroll
    for (int w = 0; w < PA_WARPS; ++w) {
        // A warp that saw no key has m = -inf and l = 0: weight 0.
        weights[w] = warp_l[w] > 0.0f ? expf(warp_m[w] - m_all) : 0.0f;
        l_all += warp_l[w] * weights[w];
    }
    const float inv_l = l_all > 0.0f ? 1.0f / l_all : 0.0f;  // context_len 0: zeros
    for (int i = threadIdx.x; i < head_dim; i += PA_THREADS) {
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < PA_WARPS; ++w) o += warp_acc[w][i] * weights[w];
        out[q_base + i] = o * inv_l;
    }
}

#define PA_KERNEL(NAME, KV)                                                              \
    extern "C" __global__ void __launch_bounds__(PA_THREADS) NAME(                       \
        float* out, const float* q, const KV* k_cache, const KV* v_cache,               \
        const int* block_tables, const int* context_lens, float scale, int num_heads,   \
        int num_kv_heads, int head_dim, int block_size, int max_blocks) {               \
        paged_attention_decode<KV>(out, q, k_cache, v_cache, block_tables, context_lens, \
                                   scale, num_heads, num_kv_heads, head_dim, block_size, \
                                   max_blocks);                                          \
    }

PA_KERNEL(paged_attention_decode_f32, float)
PA_KERNEL(paged_attention_decode_f16, f16_bits)
PA_KERNEL(paged_attention_decode_bf16, bf16_bits)

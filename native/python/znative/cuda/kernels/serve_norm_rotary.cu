// zserve's per-layer elementwise kernels, the GPU twins of zkernels::serve (CPU):
//
//   serve_rms_norm_{f32,bf16}(out, x, weight, eps, hidden)
//       out[r, :] = weight * bf16?(x[r, :] * rsqrt(mean(x[r, :]^2) + eps))
//       grid (rows), block (RN_THREADS); the row's sum of squares reduced in shared memory.
//   serve_rotary_kv_write_{f32,bf16}(qkv, cos, sin, positions, slots, k_cache, v_cache,
//                                    tokens, num_heads, num_kv_heads, head_dim)
//       q and k heads of each fused qkv row rotated in place (rotate_half layout:
//       x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype), then
//       the row's k and v heads copied to the caches (slots, kv_heads, head_dim) at its slot.
//       grid (tokens), block (RN_THREADS).
//
// Torch references: zserve.model.llama.rms_norm, apply_rotary + KVCache.write. bfloat16 is
// passed as its 16 bits (unsigned short); arithmetic is fp32. No headers: plain NVRTC.

#define RN_THREADS 256

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(unsigned short x) {
    return __uint_as_float(static_cast<unsigned int>(x) << 16);
}

// Round to nearest even, NaN kept (quietened), as tensor.to(torch.bfloat16).
__device__ __forceinline__ unsigned short bf16_round(float f) {
    unsigned int b = __float_as_uint(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>((b >> 16) | 0x40u);
    b += 0x7fffu + ((b >> 16) & 1u);
    return static_cast<unsigned short>(b >> 16);
}

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(unsigned short* p, float v) { *p = bf16_round(v); }
__device__ __forceinline__ float rnd(float v, float) { return v; }
__device__ __forceinline__ float rnd(float v, unsigned short) { return to_f(bf16_round(v)); }

template <typename T>
__device__ void rms_norm_row(T* __restrict__ out, const T* __restrict__ x,
                             const T* __restrict__ w, float eps, int hidden) {
    __shared__ float partial[RN_THREADS];
    const long long base = static_cast<long long>(blockIdx.x) * hidden;
    float ss = 0.f;
    for (int i = threadIdx.x; i < hidden; i += RN_THREADS) {
        const float v = to_f(x[base + i]);
        ss += v * v;
    }
    partial[threadIdx.x] = ss;
    __syncthreads();
    for (int s = RN_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
        __syncthreads();
    }
    const float r = 1.f / sqrtf(partial[0] / hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += RN_THREADS) {
        const float y = rnd(to_f(x[base + i]) * r, T());
        store(&out[base + i], to_f(w[i]) * y);
    }
}

template <typename T>
__device__ void rotary_kv_write_row(T* __restrict__ qkv, const T* __restrict__ cos_t,
                                    const T* __restrict__ sin_t,
                                    const long long* __restrict__ positions,
                                    const long long* __restrict__ slots,
                                    T* __restrict__ k_cache, T* __restrict__ v_cache,
                                    int num_heads, int num_kv_heads, int head_dim) {
    const int t = blockIdx.x;
    const int half = head_dim / 2;
    const int rot_heads = num_heads + num_kv_heads;
    const long long stride = static_cast<long long>(rot_heads + num_kv_heads) * head_dim;
    T* row = qkv + t * stride;
    const T* c = cos_t + positions[t] * head_dim;
    const T* s = sin_t + positions[t] * head_dim;
    for (int e = threadIdx.x; e < rot_heads * half; e += RN_THREADS) {
        const int h = e / half, i = e % half;
        T* x = row + static_cast<long long>(h) * head_dim;
        const float a = to_f(x[i]), b = to_f(x[i + half]);
        const float lo = rnd(a * to_f(c[i]), T()) + rnd(-b * to_f(s[i]), T());
        const float hi = rnd(b * to_f(c[i + half]), T()) + rnd(a * to_f(s[i + half]), T());
        store(&x[i], lo);
        store(&x[i + half], hi);
    }
    __syncthreads();
    const int kvw = num_kv_heads * head_dim;
    const long long dst = slots[t] * kvw;
    for (int e = threadIdx.x; e < kvw; e += RN_THREADS) {
        k_cache[dst + e] = row[static_cast<long long>(num_heads) * head_dim + e];
        v_cache[dst + e] = row[static_cast<long long>(rot_heads) * head_dim + e];
    }
}

#define SERVE_KERNELS(SUFFIX, T)                                                              \
    extern "C" __global__ void __launch_bounds__(RN_THREADS) serve_rms_norm_##SUFFIX(         \
        T* out, const T* x, const T* w, float eps, int hidden) {                              \
        rms_norm_row<T>(out, x, w, eps, hidden);                                              \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(RN_THREADS) serve_rotary_kv_write_##SUFFIX(  \
        T* qkv, const T* cos_t, const T* sin_t, const long long* positions,                  \
        const long long* slots, T* k_cache, T* v_cache, int num_heads, int num_kv_heads,      \
        int head_dim) {                                                                       \
        rotary_kv_write_row<T>(qkv, cos_t, sin_t, positions, slots, k_cache, v_cache,         \
                               num_heads, num_kv_heads, head_dim);                            \
    }

SERVE_KERNELS(f32, float)
SERVE_KERNELS(bf16, unsigned short)

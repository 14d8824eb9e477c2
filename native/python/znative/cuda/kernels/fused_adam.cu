// Multi-tensor fused Adam / AdamW: one launch updates every tensor of a list.
//
// Each block owns one chunk of one tensor, named by the chunk table, like
// apex's and torch's multi_tensor_apply, so a launch's cost does not grow with
// the number of tensors. All tables live in device memory:
//
//   ptrs    int64 [n_tensors, 4]  device addresses of (param, grad, exp_avg, exp_avg_sq)
//   sizes   int64 [n_tensors]     elements per tensor
//   chunks  int64 [n_chunks, 2]   (tensor index, first element); grid.x == n_chunks
//
// param, exp_avg and exp_avg_sq are fp32; grad is fp32 (fused_adam_f32) or
// bfloat16 bits (fused_adam_bf16_grad). The per-element math is torch's
// _single_tensor_adam / _multi_tensor_adam for amsgrad=False, in the same
// order, with the scalars torch derives in double precision on the host
// (step_size = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t), 1 - beta1,
// 1 - beta2, 1 - lr * weight_decay) precomputed host-side and passed as fp32,
// which is also what torch's CUDA kernels receive.
//
// No headers: compiles with plain NVRTC for any sm_XX.

struct AdamArgs {
    float beta1_weight;     // 1 - beta1: exp_avg.lerp_(grad, 1 - beta1)
    float beta2;            // exp_avg_sq.mul_(beta2)
    float beta2_weight;     // 1 - beta2: exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)
    float eps;
    float weight_decay;     // Adam: grad += weight_decay * param
    float decay_factor;     // AdamW: param *= 1 - lr * weight_decay
    float neg_step_size;    // -lr / (1 - beta1^t)
    float bc2_sqrt;         // sqrt(1 - beta2^t)
    int decoupled;          // 1: AdamW decay, 0: L2 added to the gradient
    int maximize;           // 1: ascend (grad negated)
};

__device__ __forceinline__ float grad_to_float(float g) { return g; }

// bfloat16 is the top half of an fp32: widening is a shift, exact.
__device__ __forceinline__ float grad_to_float(unsigned short bits) {
    return __uint_as_float(static_cast<unsigned int>(bits) << 16);
}

// torch's at::lerp: the branch keeps the result exact at weight 0 and 1.
__device__ __forceinline__ float torch_lerp(float self, float end, float weight) {
    return fabsf(weight) < 0.5f ? self + weight * (end - self)
                                : end - (end - self) * (1.0f - weight);
}

__device__ __forceinline__ void adam_element(
    float& p, float g, float& m, float& v, const AdamArgs& a) {
    if (a.maximize) g = -g;
    if (a.weight_decay != 0.0f) {
        if (a.decoupled) {
            p = p * a.decay_factor;
        } else {
            g = g + a.weight_decay * p;
        }
    }
    m = torch_lerp(m, g, a.beta1_weight);
    v = v * a.beta2;
    v = v + a.beta2_weight * (g * g);
    const float denom = sqrtf(v) / a.bc2_sqrt + a.eps;
    p = p + a.neg_step_size * (m / denom);
}

// 4 grads in one aligned load: 16 bytes of fp32 or 8 bytes of bf16.
template <typename G> struct Vec4;
template <> struct Vec4<float> {
    typedef float4 type;
    __device__ static void unpack(const float4& x, float out[4]) {
        out[0] = x.x; out[1] = x.y; out[2] = x.z; out[3] = x.w;
    }
};
template <> struct Vec4<unsigned short> {
    typedef ushort4 type;
    __device__ static void unpack(const ushort4& x, float out[4]) {
        out[0] = grad_to_float(x.x); out[1] = grad_to_float(x.y);
        out[2] = grad_to_float(x.z); out[3] = grad_to_float(x.w);
    }
};

// ILP float4 groups per thread are loaded before any is updated, so each thread has
// ILP * 4 loads in flight (one group leaves the memory system idle between them).
template <typename G, int ILP>
__device__ void adam_chunk(
    const long long* __restrict__ ptrs, const long long* __restrict__ sizes,
    const long long* __restrict__ chunks, long long chunk_size, const AdamArgs& a) {
    const long long tensor = chunks[2 * blockIdx.x];
    const long long start = chunks[2 * blockIdx.x + 1];
    const long long numel = sizes[tensor];
    const long long stop = start + chunk_size < numel ? start + chunk_size : numel;
    if (start >= stop) return;

    float* __restrict__ p = reinterpret_cast<float*>(ptrs[4 * tensor + 0]) + start;
    const G* __restrict__ g = reinterpret_cast<const G*>(ptrs[4 * tensor + 1]) + start;
    float* __restrict__ m = reinterpret_cast<float*>(ptrs[4 * tensor + 2]) + start;
    float* __restrict__ v = reinterpret_cast<float*>(ptrs[4 * tensor + 3]) + start;
    const long long n = stop - start;

    // Vector loads need every stream aligned to 4 elements; views with an odd
    // storage offset take the scalar loop below for the whole chunk.
    const unsigned long long misaligned =
        (reinterpret_cast<unsigned long long>(p) | reinterpret_cast<unsigned long long>(m) |
         reinterpret_cast<unsigned long long>(v)) % 16 |
        reinterpret_cast<unsigned long long>(g) % (4 * sizeof(G));
    const long long n_vec = misaligned ? 0 : n / 4;

    for (long long base = threadIdx.x; base < n_vec; base += (long long)blockDim.x * ILP) {
        float4 pv[ILP], mv[ILP], vv[ILP];
        float gv[ILP][4];
#pragma unroll
        for (int u = 0; u < ILP; ++u) {
            const long long i = base + (long long)u * blockDim.x;
            if (i < n_vec) {
                pv[u] = reinterpret_cast<float4*>(p)[i];
                mv[u] = reinterpret_cast<float4*>(m)[i];
                vv[u] = reinterpret_cast<float4*>(v)[i];
                Vec4<G>::unpack(reinterpret_cast<const typename Vec4<G>::type*>(g)[i], gv[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < ILP; ++u) {
            const long long i = base + (long long)u * blockDim.x;
            if (i < n_vec) {
                adam_element(pv[u].x, gv[u][0], mv[u].x, vv[u].x, a);
                adam_element(pv[u].y, gv[u][1], mv[u].y, vv[u].y, a);
                adam_element(pv[u].z, gv[u][2], mv[u].z, vv[u].z, a);
                adam_element(pv[u].w, gv[u][3], mv[u].w, vv[u].w, a);
                reinterpret_cast<float4*>(p)[i] = pv[u];
                reinterpret_cast<float4*>(m)[i] = mv[u];
                reinterpret_cast<float4*>(v)[i] = vv[u];
            }
        }
    }
    for (long long i = 4 * n_vec + threadIdx.x; i < n; i += blockDim.x) {
        float pi = p[i], mi = m[i], vi = v[i];
        adam_element(pi, grad_to_float(g[i]), mi, vi, a);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
    }
}

// float4 groups each thread loads at once (see adam_chunk)
#define ZNATIVE_ADAM_ILP 4

#define ZNATIVE_ADAM_PARAMS                                                                  \
    const long long* __restrict__ ptrs, const long long* __restrict__ sizes,                \
        const long long* __restrict__ chunks, long long chunk_size, float beta1_weight,     \
        float beta2, float beta2_weight, float eps, float weight_decay, float decay_factor, \
        float neg_step_size, float bc2_sqrt, int decoupled, int maximize

#define ZNATIVE_ADAM_ARGS                                                                  \
    AdamArgs a = {beta1_weight, beta2,         beta2_weight, eps,       weight_decay,      \
                  decay_factor, neg_step_size, bc2_sqrt,     decoupled, maximize}

// fp32 params, fp32 grads.
extern "C" __global__ void __launch_bounds__(512) fused_adam_f32(ZNATIVE_ADAM_PARAMS) {
    ZNATIVE_ADAM_ARGS;
    adam_chunk<float, ZNATIVE_ADAM_ILP>(ptrs, sizes, chunks, chunk_size, a);
}

// fp32 params (master weights), bfloat16 grads passed as their 16-bit patterns.
extern "C" __global__ void __launch_bounds__(512) fused_adam_bf16_grad(ZNATIVE_ADAM_PARAMS) {
    ZNATIVE_ADAM_ARGS;
    adam_chunk<unsigned short, ZNATIVE_ADAM_ILP>(ptrs, sizes, chunks, chunk_size, a);
}

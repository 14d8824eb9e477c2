// Blockwise symmetric INT8 / INT4 quantization for zcomm's collectives (ZeRO++ qwZ / qgZ).
// The rule and the torch reference are zcomm.blockquant; the CPU twins live in
// native/crates/zkernels/src/comm/blockq.rs. x is read flat and cut into blocks of `block`
// elements (the last one possibly short), one float scale per block:
//
//   qmax     = 2^(bits-1) - 1                      127 (INT8), 7 (INT4)
//   scale[b] = max|x[b]| / qmax, or 1 where that is 0
//   code     = clamp(rint(x / scale[b]), -qmax, qmax) + 2^(bits-1)     (rint: ties to even)
//   a block with a NaN or an infinity: scale NaN, every code 2^(bits-1) (level 0)
//
//   codes  uint8 [n] (bits 8) or [ceil(n/2)] (bits 4: element 2t in the low nibble of byte t,
//          an odd n leaves the last high nibble 0; block must be even)
//   scales float [ceil(n/block)]
//
// Division and rint are IEEE (NVRTC's defaults: -prec-div=true, no fast math), so the codes
// and scales equal the CPU kernel's and the torch reference's bit for bit.
//
// No headers: compiles with plain NVRTC for any sm_XX.

#define CQ_THREADS 256

__device__ __forceinline__ unsigned int quant_code(float v, float scale, float qmax, float off) {
    return (unsigned int)(fminf(fmaxf(rintf(v / scale), -qmax), qmax) + off);
}

// One CUDA block per quantization block (grid-stride over blocks), CQ_THREADS threads.
extern "C" __global__ void comm_quantize_blocks_f32(
    unsigned char* __restrict__ codes, float* __restrict__ scales, const float* __restrict__ x,
    long long n, int block, int bits) {
    __shared__ float s_max[CQ_THREADS];
    __shared__ int s_bad[CQ_THREADS];
    const long long nb = (n + block - 1) / block;
    const float qmax = (float)((1 << (bits - 1)) - 1);
    const float off = (float)(1 << (bits - 1));
    for (long long b = blockIdx.x; b < nb; b += gridDim.x) {
        const long long e0 = b * block;
        const long long len = (n - e0 < block) ? (n - e0) : block;
        float m = 0.0f;
        int bad = 0;
        for (long long t = threadIdx.x; t < len; t += blockDim.x) {
            const float v = x[e0 + t];
            m = fmaxf(m, fabsf(v));
            bad |= !isfinite(v);
        }
        s_max[threadIdx.x] = m;
        s_bad[threadIdx.x] = bad;
        __syncthreads();
        for (int s = blockDim.x / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) {
                s_max[threadIdx.x] = fmaxf(s_max[threadIdx.x], s_max[threadIdx.x + s]);
                s_bad[threadIdx.x] |= s_bad[threadIdx.x + s];
            }
            __syncthreads();
        }
        const int finite = !s_bad[0];
        const float q = s_max[0] / qmax;
        const float scale = finite ? (q > 0.0f ? q : 1.0f) : __int_as_float(0x7fc00000);
        __syncthreads();  // everyone has read s_max / s_bad before the next block reuses them
        if (threadIdx.x == 0) scales[b] = scale;
        if (bits == 8) {
            for (long long t = threadIdx.x; t < len; t += blockDim.x) {
                codes[e0 + t] = (unsigned char)(finite ? quant_code(x[e0 + t], scale, qmax, off)
                                                       : (unsigned int)off);
            }
        } else {
            const long long c0 = e0 / 2;  // block is even, so block b starts on a byte
            for (long long t = threadIdx.x; t < (len + 1) / 2; t += blockDim.x) {
                const long long e = e0 + 2 * t;
                unsigned int lo = (unsigned int)off, hi = (e + 1 < n) ? (unsigned int)off : 0u;
                if (finite) {
                    lo = quant_code(x[e], scale, qmax, off);
                    if (e + 1 < n) hi = quant_code(x[e + 1], scale, qmax, off);
                }
                codes[c0 + t] = (unsigned char)(lo | (hi << 4));
            }
        }
    }
}

// out[e] = (code - 2^(bits-1)) * scales[e / block]; one thread per element, grid-stride.
extern "C" __global__ void comm_dequantize_blocks_f32(
    float* __restrict__ out, const unsigned char* __restrict__ codes,
    const float* __restrict__ scales, long long n, int block, int bits) {
    const float off = (float)(1 << (bits - 1));
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n;
         e += (long long)gridDim.x * blockDim.x) {
        const unsigned int c = bits == 8 ? codes[e] : (codes[e >> 1] >> ((e & 1) * 4)) & 15u;
        out[e] = ((float)c - off) * scales[e / block];
    }
}

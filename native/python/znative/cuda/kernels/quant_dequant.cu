// Dequantize and dequantize-GEMV for zquant's packed weights (INT4 group-wise and
// FP6 e3m2 in the 4+2 bit split). The layouts are zquant.packing's; the torch
// reference is zquant.quantizers.dequantize_weight, and the CPU twins live in
// native/crates/zkernels/src/quant/dequant.rs.
//
//   weight (n, k), row-major, row j:
//     int4   data  uint8 [n, ceil(k/2)]  element 2t in the low nibble of byte t
//     fp6    data  uint8 [n, ceil(k/2)]  low four bits (e1 e0 m1 m0), as int4
//            data2 uint8 [n, ceil(k/4)]  high two bits (s e2), element 4t+i in bits 2i..2i+1
//   scale float [scale_rows, groups]     scale_rows = 1 (per tensor) or n; group g covers
//                                        columns g*group .. (g+1)*group - 1 (last one padded)
//   zero  float [scale_rows, groups]     asymmetric int4 only (has_zero = 1); otherwise the
//                                        level is code - offset (offset 8 for symmetric int4)
//
// FP6 uses exponent bias 3. A normal code (exponent field e > 0) decodes with shifts and
// masks alone: e + 124 is its float32 exponent field and its two mantissa bits go to bits
// 21..22. A subnormal code (e = 0) is m/16 exactly. The CPU reference's trick (build a
// float32 subnormal, multiply by 2^124) is not used here: on an H200 the subnormal codes
// came out 0 that way.
//
// No headers: compiles with plain NVRTC for any sm_XX.

#define QD_THREADS 128
#define QD_WARPS (QD_THREADS / 32)

__device__ __forceinline__ float fp6_value(unsigned int code) {
    const unsigned int e = (code >> 2) & 7u, m = code & 3u;
    const float mag = e ? __uint_as_float(((e + 124u) << 23) | (m << 21)) : (float)m * 0.0625f;
    return (code & 0x20u) ? -mag : mag;
}

__device__ __forceinline__ int scale_index(int row, int col, int groups, int group, int scale_rows) {
    return (scale_rows == 1 ? 0 : row * groups) + col / group;
}

__device__ __forceinline__ float int4_weight(
    const unsigned char* data, const float* scale, const float* zero, int has_zero, int offset,
    int row, int col, int k, int groups, int group, int scale_rows) {
    const unsigned int byte = data[(long long)row * ((k + 1) / 2) + col / 2];
    const unsigned int code = (byte >> ((col & 1) * 4)) & 15u;
    const int si = scale_index(row, col, groups, group, scale_rows);
    const float z = has_zero ? zero[si] : (float)offset;
    return ((float)code - z) * scale[si];
}

__device__ __forceinline__ float fp6_weight(
    const unsigned char* plane4, const unsigned char* plane2, const float* scale,
    int row, int col, int k, int groups, int group, int scale_rows) {
    const unsigned int lo = (plane4[(long long)row * ((k + 1) / 2) + col / 2] >> ((col & 1) * 4)) & 15u;
    const unsigned int hi = (plane2[(long long)row * ((k + 3) / 4) + col / 4] >> ((col & 3) * 2)) & 3u;
    return fp6_value((hi << 4) | lo) * scale[scale_index(row, col, groups, group, scale_rows)];
}

// out (n, k) float32; one thread per element, grid-stride.
extern "C" __global__ void dequant_int4_f32(
    float* __restrict__ out, const unsigned char* __restrict__ data,
    const float* __restrict__ scale, const float* __restrict__ zero, int has_zero, int offset,
    int n, int k, int group, int scale_rows) {
    const int groups = (k + group - 1) / group;
    const long long total = (long long)n * k;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int row = (int)(i / k), col = (int)(i % k);
        out[i] = int4_weight(data, scale, zero, has_zero, offset, row, col, k, groups, group, scale_rows);
    }
}

extern "C" __global__ void dequant_fp6_f32(
    float* __restrict__ out, const unsigned char* __restrict__ plane4,
    const unsigned char* __restrict__ plane2, const float* __restrict__ scale,
    int n, int k, int group, int scale_rows) {
    const int groups = (k + group - 1) / group;
    const long long total = (long long)n * k;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int row = (int)(i / k), col = (int)(i % k);
        out[i] = fp6_weight(plane4, plane2, scale, row, col, k, groups, group, scale_rows);
    }
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}

// out (m, n) = x (m, k) @ dequant(w)^T + bias: one warp per (output row j, token i);
// grid (ceil(n / QD_WARPS), m), block QD_THREADS. The weight is read once per token
// straight from its packed form: the GEMV is bound by weight bytes, 4-8x fewer than fp32.
extern "C" __global__ void int4_gemv_f32(
    float* __restrict__ out, const float* __restrict__ x, const unsigned char* __restrict__ data,
    const float* __restrict__ scale, const float* __restrict__ zero, int has_zero, int offset,
    const float* __restrict__ bias, int has_bias, int m, int n, int k, int group, int scale_rows) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int j = blockIdx.x * QD_WARPS + warp, i = blockIdx.y;
    if (j >= n || i >= m) return;
    const int groups = (k + group - 1) / group;
    const float* xr = x + (long long)i * k;
    float acc = 0.0f;
    for (int c = lane; c < k; c += 32) {
        acc += xr[c] * int4_weight(data, scale, zero, has_zero, offset, j, c, k, groups, group, scale_rows);
    }
    acc = warp_sum(acc);
    if (lane == 0) out[(long long)i * n + j] = acc + (has_bias ? bias[j] : 0.0f);
}

extern "C" __global__ void fp6_gemv_f32(
    float* __restrict__ out, const float* __restrict__ x, const unsigned char* __restrict__ plane4,
    const unsigned char* __restrict__ plane2, const float* __restrict__ scale,
    const float* __restrict__ bias, int has_bias, int m, int n, int k, int group, int scale_rows) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int j = blockIdx.x * QD_WARPS + warp, i = blockIdx.y;
    if (j >= n || i >= m) return;
    const int groups = (k + group - 1) / group;
    const float* xr = x + (long long)i * k;
    float acc = 0.0f;
    for (int c = lane; c < k; c += 32) {
        acc += xr[c] * fp6_weight(plane4, plane2, scale, j, c, k, groups, group, scale_rows);
    }
    acc = warp_sum(acc);
    if (lane == 0) out[(long long)i * n + j] = acc + (has_bias ? bias[j] : 0.0f);
}

// 1-bit compression for zcomm's compressed all-reduce: signs packed 8 to a byte, the
// sum of squares (for the scale ||x|| / sqrt(n)) from the same pass, and the unpack that
// writes scale * (+1 / -1). The layout and the torch reference are zcomm.signs; the CPU
// twins live in native/crates/zkernels/src/comm/signs.rs.
//
//   x       float [n]  (or bfloat16 bits, unsigned short [n])
//   packed  uint8 [ceil(n/8)]  element 8i+j is bit 7-j of byte i (most significant first);
//                              1 where the element is not negative (+0, -0 and NaN are 1);
//                              the unused low bits of a last partial byte are 0
//   sumsq   double [1]         accumulated with atomicAdd (zero it before the launch); its
//                              last bits depend on the summation order, unlike the bits
//
// No headers: compiles with plain NVRTC for any sm_XX (double atomicAdd needs sm_60+).

#define CS_THREADS 256

__device__ __forceinline__ float bf16_to_f32(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}

template <typename T>
__device__ __forceinline__ float load_f32(const T* x, long long i);

template <>
__device__ __forceinline__ float load_f32<float>(const float* x, long long i) { return x[i]; }

template <>
__device__ __forceinline__ float load_f32<unsigned short>(const unsigned short* x, long long i) {
    return bf16_to_f32(x[i]);
}

// One thread per output byte, grid-stride; each warp adds its squares to *sumsq once.
template <typename T>
__device__ void pack_signs(unsigned char* __restrict__ packed, double* __restrict__ sumsq,
                           const T* __restrict__ x, long long n) {
    const long long bytes = (n + 7) / 8;
    const long long stride = (long long)gridDim.x * blockDim.x;
    double acc = 0.0;
    // Every thread of a warp runs the same number of iterations, so the shuffle below is
    // reached by all 32 lanes.
    const long long first = blockIdx.x * (long long)blockDim.x;
    for (long long base = first; base < bytes; base += stride) {
        const long long i = base + threadIdx.x;
        if (i < bytes) {
            unsigned int byte = 0;
            float sq = 0.0f;
            for (int j = 0; j < 8; ++j) {
                const long long e = 8 * i + j;
                if (e < n) {
                    const float v = load_f32<T>(x, e);
                    sq += v * v;
                    byte |= (unsigned int)(!(v < 0.0f)) << (7 - j);
                }
            }
            packed[i] = (unsigned char)byte;
            acc += (double)sq;
        }
    }
    acc = warp_sum_d(acc);
    if ((threadIdx.x & 31) == 0) atomicAdd(sumsq, acc);
}

extern "C" __global__ void comm_pack_signs_f32(
    unsigned char* __restrict__ packed, double* __restrict__ sumsq, const float* __restrict__ x,
    long long n) {
    pack_signs<float>(packed, sumsq, x, n);
}

extern "C" __global__ void comm_pack_signs_bf16(
    unsigned char* __restrict__ packed, double* __restrict__ sumsq,
    const unsigned short* __restrict__ x, long long n) {
    pack_signs<unsigned short>(packed, sumsq, x, n);
}

// out[e] = scale where bit e is 1, -scale where it is 0; one thread per element, grid-stride.
extern "C" __global__ void comm_unpack_signs_f32(
    float* __restrict__ out, const unsigned char* __restrict__ packed, float scale, long long n) {
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n;
         e += (long long)gridDim.x * blockDim.x) {
        const unsigned int bit = (packed[e >> 3] >> (7 - (e & 7))) & 1u;
        out[e] = bit ? scale : -scale;
    }
}

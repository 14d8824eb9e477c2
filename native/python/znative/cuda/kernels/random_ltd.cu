// Random-LTD token routing: copy the kept tokens of each sample out of the hidden states
// (gather) and write a layer's output for them back in place (scatter). The torch
// reference and the autograd wiring are zcore.data_efficiency.token_routing; these are its
// CUDA twins, selected there for CUDA tensors when CuPy is present.
//
//   x     [B, T, C]  hidden states (any 2- or 4-byte element: the kernels copy words)
//   idx   [B, K]     int64, kept positions of each sample, each in [0, T)
//   part  [B, K, C]  x at idx
//
// One block per kept row (b, k), threads striding over its C words. Rows are disjoint
// (the positions of a sample are distinct), so the scatter needs no atomics.
// No headers: compiles with plain NVRTC for any sm_XX.

template <typename W>
__device__ __forceinline__ void copy_row(W* __restrict__ dst, const W* __restrict__ src,
                                         long long words) {
    for (long long c = threadIdx.x; c < words; c += blockDim.x) dst[c] = src[c];
}

// part[b, k, :] = x[b, idx[b, k], :]
template <typename W>
__device__ void gather_rows(W* __restrict__ part, const W* __restrict__ x,
                            const long long* __restrict__ idx, long long T, long long K,
                            long long words) {
    const long long row = blockIdx.x;  // b * K + k
    const long long b = row / K;
    const long long t = idx[row];
    copy_row(part + row * words, x + (b * T + t) * words, words);
}

// x[b, idx[b, k], :] = part[b, k, :]
template <typename W>
__device__ void scatter_rows(W* __restrict__ x, const W* __restrict__ part,
                             const long long* __restrict__ idx, long long T, long long K,
                             long long words) {
    const long long row = blockIdx.x;
    const long long b = row / K;
    const long long t = idx[row];
    copy_row(x + (b * T + t) * words, part + row * words, words);
}

extern "C" __global__ void random_ltd_gather_w32(unsigned int* part, const unsigned int* x,
                                                 const long long* idx, long long T,
                                                 long long K, long long words) {
    gather_rows<unsigned int>(part, x, idx, T, K, words);
}

extern "C" __global__ void random_ltd_gather_w16(unsigned short* part, const unsigned short* x,
                                                 const long long* idx, long long T,
                                                 long long K, long long words) {
    gather_rows<unsigned short>(part, x, idx, T, K, words);
}

extern "C" __global__ void random_ltd_scatter_w32(unsigned int* x, const unsigned int* part,
                                                  const long long* idx, long long T,
                                                  long long K, long long words) {
    scatter_rows<unsigned int>(x, part, idx, T, K, words);
}

extern "C" __global__ void random_ltd_scatter_w16(unsigned short* x, const unsigned short* part,
                                                  const long long* idx, long long T,
                                                  long long K, long long words) {
    scatter_rows<unsigned short>(x, part, idx, T, K, words);
}

// vigil memory integrity test: CUDA kernels and their host launchers.
//
// Patterns in the style of memtest86 / cuda_memtest: constant words (walking ones, moving
// inversions with a pattern and its complement, ascending then descending) and
// address-in-address (each word holds its own address, then its complement). Words are 32-bit,
// accessed as uint4 so a pass runs at HBM speed. A failing word is counted and the lowest failing
// word index is kept; a planted fault (index >= 0) xors `fault_mask` into one word on every
// write, which is how tests show a stuck bit is caught. No torch headers here: the launchers take
// raw pointers and a cudaStream_t passed as void*, so nvcc builds this file on its own
// (`nvcc -arch=sm_90 -c memtest.cu`) and memtest_binding.cpp wraps it for torch.
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kThreads = 512;
constexpr int kBlocksPerSm = 8;

enum Kind : int { kConstant = 0, kAddress = 1, kAddressInverted = 2 };

__device__ __forceinline__ uint32_t expected_word(int kind, uint32_t pattern, const uint32_t* base,
                                                  uint64_t i) {
  if (kind == kConstant) return pattern;
  const uint32_t address = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(base + i) >> 2);
  return kind == kAddress ? address : ~address;
}

__device__ __forceinline__ uint4 expected_vec(int kind, uint32_t pattern, const uint32_t* base,
                                              uint64_t i) {
  return make_uint4(expected_word(kind, pattern, base, i), expected_word(kind, pattern, base, i + 1),
                    expected_word(kind, pattern, base, i + 2),
                    expected_word(kind, pattern, base, i + 3));
}

__device__ __forceinline__ uint4 with_fault(uint4 w, uint64_t i, int64_t fault_index,
                                            uint32_t fault_mask) {
  if (fault_index < 0) return w;
  const uint64_t f = static_cast<uint64_t>(fault_index);
  if (f < i || f >= i + 4) return w;
  switch (f - i) {
    case 0: w.x ^= fault_mask; break;
    case 1: w.y ^= fault_mask; break;
    case 2: w.z ^= fault_mask; break;
    default: w.w ^= fault_mask; break;
  }
  return w;
}

// log[0]: failing words; log[1]: lowest failing word index (initialised to ~0 by the caller).
__device__ __forceinline__ void check(uint4 got, uint4 want, uint64_t i, unsigned long long* log) {
  const uint32_t g[4] = {got.x, got.y, got.z, got.w};
  const uint32_t e[4] = {want.x, want.y, want.z, want.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (g[k] != e[k]) {
      atomicAdd(&log[0], 1ULL);
      atomicMin(&log[1], static_cast<unsigned long long>(i + k));
    }
  }
}

__device__ __forceinline__ bool differs(uint4 a, uint4 b) {
  return (a.x ^ b.x) | (a.y ^ b.y) | (a.z ^ b.z) | (a.w ^ b.w);
}

__global__ void fill_kernel(uint32_t* buf, uint64_t n4, int kind, uint32_t pattern,
                            int64_t fault_index, uint32_t fault_mask) {
  uint4* vec = reinterpret_cast<uint4*>(buf);
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t v = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < n4;
       v += stride) {
    const uint64_t i = v * 4;
    vec[v] = with_fault(expected_vec(kind, pattern, buf, i), i, fault_index, fault_mask);
  }
}

__global__ void verify_kernel(const uint32_t* buf, uint64_t n4, int kind, uint32_t pattern,
                              unsigned long long* log) {
  const uint4* vec = reinterpret_cast<const uint4*>(buf);
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t v = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < n4;
       v += stride) {
    const uint64_t i = v * 4;
    const uint4 got = vec[v];
    const uint4 want = expected_vec(kind, pattern, buf, i);
    if (differs(got, want)) check(got, want, i, log);
  }
}

// Moving inversions: check every word holds `expect`, then write `write` into it, walking the
// buffer upwards or (descending != 0) downwards.
__global__ void verify_write_kernel(uint32_t* buf, uint64_t n4, uint32_t expect, uint32_t write,
                                    int descending, unsigned long long* log, int64_t fault_index,
                                    uint32_t fault_mask) {
  uint4* vec = reinterpret_cast<uint4*>(buf);
  const uint4 want = make_uint4(expect, expect, expect, expect);
  const uint4 next = make_uint4(write, write, write, write);
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t t = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < n4;
       t += stride) {
    const uint64_t v = descending ? n4 - 1 - t : t;
    const uint64_t i = v * 4;
    const uint4 got = vec[v];
    if (differs(got, want)) check(got, want, i, log);
    vec[v] = with_fault(next, i, fault_index, fault_mask);
  }
}

int grid_for(uint64_t n4) {
  int device = 0;
  int sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    sms = 132;
  }
  const uint64_t needed = (n4 + kThreads - 1) / kThreads;
  const uint64_t cap = static_cast<uint64_t>(sms) * kBlocksPerSm;
  return static_cast<int>(needed < cap ? (needed > 0 ? needed : 1) : cap);
}

}  // namespace

// Launchers: `n` counts 32-bit words and must be a multiple of 4; `buf` 16-byte aligned.
// Each returns the cudaError_t of the launch (0 on success).
int vigil_memtest_fill(uint32_t* buf, uint64_t n, int kind, uint32_t pattern, int64_t fault_index,
                       uint32_t fault_mask, void* stream) {
  const uint64_t n4 = n / 4;
  fill_kernel<<<grid_for(n4), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      buf, n4, kind, pattern, fault_index, fault_mask);
  return static_cast<int>(cudaGetLastError());
}

int vigil_memtest_verify(const uint32_t* buf, uint64_t n, int kind, uint32_t pattern,
                         unsigned long long* log, void* stream) {
  const uint64_t n4 = n / 4;
  verify_kernel<<<grid_for(n4), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(buf, n4, kind,
                                                                                    pattern, log);
  return static_cast<int>(cudaGetLastError());
}

int vigil_memtest_verify_write(uint32_t* buf, uint64_t n, uint32_t expect, uint32_t write,
                               int descending, unsigned long long* log, int64_t fault_index,
                               uint32_t fault_mask, void* stream) {
  const uint64_t n4 = n / 4;
  verify_write_kernel<<<grid_for(n4), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      buf, n4, expect, write, descending, log, fault_index, fault_mask);
  return static_cast<int>(cudaGetLastError());
}

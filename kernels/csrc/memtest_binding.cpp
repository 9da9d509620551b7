// torch bindings of vigil's CUDA memory test (memtest.cu): check tensors, launch, raise on error.
// Built at run time by torch.utils.cpp_extension.load on CUDA hosts (vigil/kernels/memtest.py).
#include <torch/extension.h>

#include <cstdint>

int vigil_memtest_fill(uint32_t* buf, uint64_t n, int kind, uint32_t pattern, int64_t fault_index,
                       uint32_t fault_mask, void* stream);
int vigil_memtest_verify(const uint32_t* buf, uint64_t n, int kind, uint32_t pattern,
                         unsigned long long* log, void* stream);
int vigil_memtest_verify_write(uint32_t* buf, uint64_t n, uint32_t expect, uint32_t write,
                               int descending, unsigned long long* log, int64_t fault_index,
                               uint32_t fault_mask, void* stream);

namespace {

uint32_t* words(const torch::Tensor& buf) {
  TORCH_CHECK(buf.is_cuda(), "memtest buffer must be a CUDA tensor");
  TORCH_CHECK(buf.scalar_type() == torch::kInt32, "memtest buffer must be int32");
  TORCH_CHECK(buf.is_contiguous(), "memtest buffer must be contiguous");
  TORCH_CHECK(buf.numel() % 4 == 0, "memtest buffer length must be a multiple of 4 words");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(buf.data_ptr()) % 16 == 0,
              "memtest buffer must be 16-byte aligned");
  return reinterpret_cast<uint32_t*>(buf.data_ptr<int32_t>());
}

unsigned long long* error_log(const torch::Tensor& log) {
  TORCH_CHECK(log.is_cuda() && log.scalar_type() == torch::kInt64 && log.numel() == 2,
              "memtest error log must be a CUDA int64 tensor of 2 elements");
  return reinterpret_cast<unsigned long long*>(log.data_ptr<int64_t>());
}

void check_launch(int err, const char* what) {
  TORCH_CHECK(err == 0, "memtest ", what, " launch failed with CUDA error ", err);
}

}  // namespace

void fill(torch::Tensor buf, int64_t kind, int64_t pattern, int64_t fault_index, int64_t fault_mask,
          int64_t stream) {
  check_launch(vigil_memtest_fill(words(buf), buf.numel(), static_cast<int>(kind),
                                  static_cast<uint32_t>(pattern), fault_index,
                                  static_cast<uint32_t>(fault_mask),
                                  reinterpret_cast<void*>(stream)),
               "fill");
}

void verify(torch::Tensor buf, int64_t kind, int64_t pattern, torch::Tensor log, int64_t stream) {
  check_launch(vigil_memtest_verify(words(buf), buf.numel(), static_cast<int>(kind),
                                    static_cast<uint32_t>(pattern), error_log(log),
                                    reinterpret_cast<void*>(stream)),
               "verify");
}

void verify_write(torch::Tensor buf, int64_t expect, int64_t write, bool descending,
                  torch::Tensor log, int64_t fault_index, int64_t fault_mask, int64_t stream) {
  check_launch(vigil_memtest_verify_write(
                   words(buf), buf.numel(), static_cast<uint32_t>(expect),
                   static_cast<uint32_t>(write), descending ? 1 : 0, error_log(log), fault_index,
                   static_cast<uint32_t>(fault_mask), reinterpret_cast<void*>(stream)),
               "verify_write");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fill", &fill, "fill words with a pattern (constant, address, inverted address)");
  m.def("verify", &verify, "count words that differ from a pattern");
  m.def("verify_write", &verify_write, "moving inversions: check one word value, write another");
}

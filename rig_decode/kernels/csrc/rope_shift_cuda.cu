// CUDA kernel of rig_decode::rope_shift_ (schema and CPU kernel in rope_shift.cpp): one thread block
// per (position, head), its threads striding over the rotated pairs.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

namespace rig_decode {

// Defined in rope_shift.cpp.
void check_rope_shift_args(const at::Tensor& keys, const at::Tensor& rows, const at::Tensor& cols,
                           const at::Tensor& shift, const at::Tensor& inv_freq);

namespace {

template <typename scalar_t>
__global__ void rope_shift_kernel(scalar_t* __restrict__ keys, const int64_t* __restrict__ rows,
                                  const int64_t* __restrict__ cols, const float* __restrict__ shift,
                                  const float* __restrict__ inv_freq, int64_t heads, int64_t half, int64_t s0,
                                  int64_t s1, int64_t s2, int64_t s3) {
  const int64_t n = blockIdx.x / heads, h = blockIdx.x % heads;
  scalar_t* x1 = keys + rows[n] * s0 + h * s1 + cols[n] * s2;
  scalar_t* x2 = x1 + half * s3;
  const float pos = shift[n];
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    float sin_a, cos_a;
    sincosf(pos * inv_freq[i], &sin_a, &cos_a);  // fp32 angle, as in the reference
    const float a = static_cast<float>(x1[i * s3]);
    const float b = static_cast<float>(x2[i * s3]);
    x1[i * s3] = static_cast<scalar_t>(a * cos_a - b * sin_a);
    x2[i * s3] = static_cast<scalar_t>(b * cos_a + a * sin_a);
  }
}

at::Tensor& rope_shift_cuda(at::Tensor& keys, const at::Tensor& rows, const at::Tensor& cols,
                            const at::Tensor& shift, const at::Tensor& inv_freq) {
  check_rope_shift_args(keys, rows, cols, shift, inv_freq);
  TORCH_CHECK(keys.is_cuda(), "rope_shift_: keys must be a CUDA tensor when any argument is, got ", keys.device());
  const int64_t n_pos = rows.numel();
  const int64_t heads = keys.size(1), half = keys.size(3) / 2;
  if (n_pos == 0) {
    return keys;
  }
  TORCH_CHECK(n_pos * heads <= std::numeric_limits<int32_t>::max(), "rope_shift_: ", n_pos, " positions x ", heads,
              " heads exceed one launch");
  const c10::cuda::CUDAGuard guard(keys.device());
  // Small side tensors may come from the host; the kernel reads them on the device.
  const at::Tensor rows_d = rows.to(keys.device()).contiguous();
  const at::Tensor cols_d = cols.to(keys.device()).contiguous();
  const at::Tensor shift_d = shift.to(keys.device(), at::kFloat).contiguous();
  const at::Tensor inv_freq_d = inv_freq.to(keys.device(), at::kFloat).contiguous();
  // An out-of-range index would write outside keys: check on the device, one sync, before any write.
  const at::Tensor bad = (rows_d < 0) | (rows_d >= keys.size(0)) | (cols_d < 0) | (cols_d >= keys.size(2));
  TORCH_CHECK_INDEX(!bad.any().item<bool>(), "rope_shift_: a (row, column) index is outside keys of shape ",
                    keys.sizes());
  if (heads == 0 || half == 0) {
    return keys;
  }

  const int threads = static_cast<int>(std::min<int64_t>(256, (half + 31) / 32 * 32));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, keys.scalar_type(), "rope_shift_cuda", [&] {
    rope_shift_kernel<scalar_t><<<static_cast<unsigned int>(n_pos * heads), threads, 0, stream>>>(
        keys.data_ptr<scalar_t>(), rows_d.data_ptr<int64_t>(), cols_d.data_ptr<int64_t>(), shift_d.data_ptr<float>(),
        inv_freq_d.data_ptr<float>(), heads, half, keys.stride(0), keys.stride(1), keys.stride(2), keys.stride(3));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return keys;
}

}  // namespace

TORCH_LIBRARY_IMPL(rig_decode, CUDA, m) {
  m.impl("rope_shift_", &rope_shift_cuda);
}

}  // namespace rig_decode

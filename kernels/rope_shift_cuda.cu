// CUDA kernel of rig_decode::rope_shift_layers_ (schema and CPU kernel in rope_shift.cpp): one
// thread block per (position, head), its threads striding over the rotated pairs; one launch per
// layer, the arguments checked, moved to the device and turned into cos / sin tables once for all.

#include "rope_shift.h"

#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

namespace rig_decode {

namespace {

// The side tensors on the device. A host tensor goes through pinned memory, so its copy is queued on
// the stream instead of waiting for the work before it (a plain copy from pageable memory would).
at::Tensor on_device(const at::Tensor& t, const at::Device& device, at::ScalarType dtype) {
  if (t.is_cpu()) {
    return t.to(dtype).contiguous().pin_memory().to(device, dtype, /*non_blocking=*/true);
  }
  return t.to(device, dtype).contiguous();
}

template <typename scalar_t>
__global__ void rope_shift_kernel(scalar_t* __restrict__ keys, const int64_t* __restrict__ rows,
                                  const int64_t* __restrict__ cols, const float* __restrict__ cos_t,
                                  const float* __restrict__ sin_t, int64_t heads, int64_t half, int64_t s0, int64_t s1,
                                  int64_t s2, int64_t step, int64_t pair) {
  const int64_t n = blockIdx.x / heads, h = blockIdx.x % heads;
  scalar_t* x1 = keys + rows[n] * s0 + h * s1 + cols[n] * s2;
  scalar_t* x2 = x1 + pair;  // pair i: (x1[i * step], x2[i * step])
  const float* cos_a = cos_t + n * half;
  const float* sin_a = sin_t + n * half;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    const float a = static_cast<float>(x1[i * step]);
    const float b = static_cast<float>(x2[i * step]);
    x1[i * step] = static_cast<scalar_t>(a * cos_a[i] - b * sin_a[i]);
    x2[i * step] = static_cast<scalar_t>(b * cos_a[i] + a * sin_a[i]);
  }
}

void rope_shift_layers_cuda(at::TensorList layers, const at::Tensor& rows, const at::Tensor& cols,
                            const at::Tensor& shift, const at::Tensor& inv_freq, bool interleaved) {
  check_rope_shift_args(layers, rows, cols, shift, inv_freq);
  if (layers.empty()) {
    return;
  }
  const at::Tensor& first = layers[0];
  TORCH_CHECK(first.is_cuda(), "rope_shift_layers_: keys must be CUDA tensors when any argument is, got ",
              first.device());
  const int64_t n_pos = rows.numel(), heads = first.size(1), half = first.size(3) / 2;
  TORCH_CHECK(n_pos * heads <= std::numeric_limits<int32_t>::max(), "rope_shift_layers_: ", n_pos, " positions x ",
              heads, " heads exceed one launch");
  const c10::cuda::CUDAGuard guard(first.device());
  // An out-of-range index would write outside keys: every index is checked before any write, on the
  // host when the indices are there (no sync), else on the device (one sync for all layers).
  if (rows.is_cpu() && cols.is_cpu()) {
    check_rope_shift_indices_on_host(first, rows, cols);
  } else if (n_pos > 0) {
    const at::Tensor r = rows.to(first.device()), c = cols.to(first.device());
    const at::Tensor bad = (r < 0) | (r >= first.size(0)) | (c < 0) | (c >= first.size(2));
    TORCH_CHECK_INDEX(!bad.any().item<bool>(), "rope_shift_layers_: a (row, column) index is outside keys of shape ",
                      first.sizes(), " (checked on the device: give the indices on the host to learn which)");
  }
  if (n_pos == 0 || heads == 0 || half == 0) {
    return;
  }

  const at::Tensor rows_d = on_device(rows, first.device(), at::kLong);
  const at::Tensor cols_d = on_device(cols, first.device(), at::kLong);
  const auto [cos_t, sin_t] = rope_shift_cos_sin(on_device(shift, first.device(), at::kFloat),
                                                 on_device(inv_freq, first.device(), at::kFloat));
  const float* cos_p = cos_t.data_ptr<float>();
  const float* sin_p = sin_t.data_ptr<float>();
  const int threads = static_cast<int>(std::min<int64_t>(256, (half + 31) / 32 * 32));
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, first.scalar_type(), "rope_shift_cuda", [&] {
    for (const at::Tensor& keys : layers) {
      const auto [step, pair] = pair_strides(keys, interleaved);
      rope_shift_kernel<scalar_t><<<static_cast<unsigned int>(n_pos * heads), threads, 0, stream>>>(
          keys.data_ptr<scalar_t>(), rows_d.data_ptr<int64_t>(), cols_d.data_ptr<int64_t>(), cos_p, sin_p, heads, half,
          keys.stride(0), keys.stride(1), keys.stride(2), step, pair);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(rig_decode, CUDA, m) {
  m.impl("rope_shift_layers_", &rope_shift_layers_cuda);
}

}  // namespace rig_decode

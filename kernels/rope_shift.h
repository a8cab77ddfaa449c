// rig_decode::rope_shift_layers_: what the CPU kernel (rope_shift.cpp) and the CUDA kernel
// (rope_shift_cuda.cu) share.

#pragma once

#include <ATen/ATen.h>

#include <utility>

namespace rig_decode {

// Everything but the index bounds: every layer of one shape, dtype and device, no two sharing
// memory, and arguments that fit them; a bad call raises before anything is written.
void check_rope_shift_args(at::TensorList layers, const at::Tensor& rows, const at::Tensor& cols,
                           const at::Tensor& shift, const at::Tensor& inv_freq);

// The index bounds, read on the host: rows and cols must be CPU tensors.
void check_rope_shift_indices_on_host(const at::Tensor& keys, const at::Tensor& rows, const at::Tensor& cols);

// Where the pairs of a key's dimensions are, in elements: pair i is (i * step, i * step + pair) from
// the key's first dimension; (i, i + head_dim/2) or, interleaved, (2i, 2i + 1).
std::pair<int64_t, int64_t> pair_strides(const at::Tensor& keys, bool interleaved);

// cos and sin of shift[n] * inv_freq[i], fp32 [N, head_dim / 2] on the tensors' device, by the same
// torch ops as the reference (rope.py), so the angles match it bit for bit on the same device.
std::pair<at::Tensor, at::Tensor> rope_shift_cos_sin(const at::Tensor& shift, const at::Tensor& inv_freq);

}  // namespace rig_decode

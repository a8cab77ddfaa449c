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

// cos and sin of shift[n] * inv_freq[i], fp32 [N, head_dim / 2] on the tensors' device, by the same
// torch ops as the reference (rope.py), so the angles match it bit for bit on the same device.
std::pair<at::Tensor, at::Tensor> rope_shift_cos_sin(const at::Tensor& shift, const at::Tensor& inv_freq);

}  // namespace rig_decode

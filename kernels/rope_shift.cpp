// rig_decode::rope_shift_layers_: rotate cached RoPE keys to new positions in place, in every layer
// of a cache at once. The op schema, the argument checks shared with the CUDA kernel, and the CPU
// kernel. Semantics are those of rope_shift_ref_ in rig_decode/kernels/rope.py, on each layer.

#include "rope_shift.h"

#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace rig_decode {

namespace {

// Two layers sharing memory (the same keys listed twice) would be rotated twice: the bytes each
// layer spans must be disjoint.
void check_layers_disjoint(at::TensorList layers) {
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;  // first and last byte of each layer
  for (const at::Tensor& layer : layers) {
    if (layer.numel() == 0) {
      continue;
    }
    int64_t low = 0, high = 0;  // element offsets of the lowest and the highest element
    for (int64_t d = 0; d < layer.dim(); ++d) {
      const int64_t reach = (layer.size(d) - 1) * layer.stride(d);
      if (reach < 0) {
        low += reach;
      } else {
        high += reach;
      }
    }
    const auto base = reinterpret_cast<uintptr_t>(layer.data_ptr());
    const int64_t item = layer.element_size();
    spans.emplace_back(base + low * item, base + (high + 1) * item - 1);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    TORCH_CHECK_VALUE(spans[i].first > spans[i - 1].second,
                      "rope_shift_layers_: two layers share memory (the same keys listed twice?): they would be "
                      "rotated twice");
  }
}

}  // namespace

void check_rope_shift_args(at::TensorList layers, const at::Tensor& rows, const at::Tensor& cols,
                           const at::Tensor& shift, const at::Tensor& inv_freq) {
  TORCH_CHECK_VALUE(rows.dim() == 1 && rows.sizes().equals(cols.sizes()) && rows.sizes().equals(shift.sizes()),
                    "rope_shift_layers_: rows, cols and shift must be 1-D of one length, got ", rows.sizes(), ", ",
                    cols.sizes(), ", ", shift.sizes());
  TORCH_CHECK_TYPE(rows.scalar_type() == at::kLong && cols.scalar_type() == at::kLong,
                   "rope_shift_layers_: rows and cols must be int64, got ", rows.scalar_type(), " and ",
                   cols.scalar_type());
  TORCH_CHECK_TYPE(!shift.is_complex() && shift.scalar_type() != at::kBool,
                   "rope_shift_layers_: shift must be a real number type, got ", shift.scalar_type());
  TORCH_CHECK_TYPE(at::isFloatingType(inv_freq.scalar_type()),
                   "rope_shift_layers_: inv_freq must be floating point, got ", inv_freq.scalar_type());
  if (layers.empty()) {
    return;
  }
  const at::Tensor& keys = layers[0];
  TORCH_CHECK_VALUE(keys.dim() == 4, "rope_shift_layers_: keys must be [batch, heads, columns, head_dim], got shape ",
                    keys.sizes());
  const auto dtype = keys.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf,
                   "rope_shift_layers_: keys must be float32, float64, bfloat16 or float16, got ", dtype);
  const int64_t head_dim = keys.size(3);
  TORCH_CHECK_VALUE(head_dim % 2 == 0, "rope_shift_layers_: head_dim must be even for RoPE, got ", head_dim);
  TORCH_CHECK_VALUE(inv_freq.numel() == head_dim / 2, "rope_shift_layers_: inv_freq has ", inv_freq.numel(),
                    " entries; head_dim ", head_dim, " needs ", head_dim / 2);
  for (const at::Tensor& layer : layers) {
    TORCH_CHECK_VALUE(layer.sizes().equals(keys.sizes()) && layer.scalar_type() == dtype &&
                          layer.device() == keys.device(),
                      "rope_shift_layers_: every layer's keys must have one shape, dtype and device, got ",
                      keys.sizes(), " ", dtype, " on ", keys.device(), " and ", layer.sizes(), " ",
                      layer.scalar_type(), " on ", layer.device());
    // Two elements sharing memory (an expanded view) would be rotated twice.
    TORCH_CHECK_VALUE(at::has_internal_overlap(layer) != at::MemOverlap::Yes, "rope_shift_layers_: keys of shape ",
                      layer.sizes(), " and strides ", layer.strides(), " hold one element at several indices "
                      "(expanded?): it would be rotated more than once");
  }
  check_layers_disjoint(layers);
}

void check_rope_shift_indices_on_host(const at::Tensor& keys, const at::Tensor& rows, const at::Tensor& cols) {
  const at::Tensor rows_c = rows.contiguous(), cols_c = cols.contiguous();
  const int64_t* row = rows_c.data_ptr<int64_t>();
  const int64_t* col = cols_c.data_ptr<int64_t>();
  const int64_t batch = keys.size(0), columns = keys.size(2);
  for (int64_t n = 0; n < rows_c.numel(); ++n) {
    TORCH_CHECK_INDEX(row[n] >= 0 && row[n] < batch && col[n] >= 0 && col[n] < columns,
                      "rope_shift_layers_: (row, column) index (", row[n], ", ", col[n], ") at position ", n,
                      " is outside keys of shape ", keys.sizes());
  }
}

std::pair<int64_t, int64_t> pair_strides(const at::Tensor& keys, bool interleaved) {
  const int64_t s3 = keys.stride(3);
  return interleaved ? std::make_pair(2 * s3, s3) : std::make_pair(s3, keys.size(3) / 2 * s3);
}

std::pair<at::Tensor, at::Tensor> rope_shift_cos_sin(const at::Tensor& shift, const at::Tensor& inv_freq) {
  const at::Tensor angle = shift.to(at::kFloat).unsqueeze(1) * inv_freq.to(at::kFloat).reshape({1, -1});
  return {angle.cos().contiguous(), angle.sin().contiguous()};
}

namespace {

// Pair i of a key at x1: (x1[i * step], x1[i * step + pair]).
template <typename scalar_t>
inline void rotate_pairs(scalar_t* x1, int64_t step, int64_t pair, const float* cos_a, const float* sin_a,
                         int64_t half) {
  scalar_t* x2 = x1 + pair;
  for (int64_t i = 0; i < half; ++i) {
    const float a = static_cast<float>(x1[i * step]);
    const float b = static_cast<float>(x2[i * step]);
    x1[i * step] = static_cast<scalar_t>(a * cos_a[i] - b * sin_a[i]);
    x2[i * step] = static_cast<scalar_t>(b * cos_a[i] + a * sin_a[i]);
  }
}

void rope_shift_layers_cpu(at::TensorList layers, const at::Tensor& rows, const at::Tensor& cols,
                           const at::Tensor& shift, const at::Tensor& inv_freq, bool interleaved) {
  check_rope_shift_args(layers, rows, cols, shift, inv_freq);
  if (layers.empty()) {
    return;
  }
  // All indices are checked before the first write, so a bad call leaves every layer untouched.
  check_rope_shift_indices_on_host(layers[0], rows, cols);
  const int64_t n_pos = rows.numel(), heads = layers[0].size(1), half = layers[0].size(3) / 2;
  if (n_pos == 0 || heads == 0 || half == 0) {
    return;
  }
  const at::Tensor rows_c = rows.contiguous(), cols_c = cols.contiguous();
  const int64_t* row = rows_c.data_ptr<int64_t>();
  const int64_t* col = cols_c.data_ptr<int64_t>();
  const auto [cos_t, sin_t] = rope_shift_cos_sin(shift, inv_freq);  // once for every layer
  const float* cos_p = cos_t.data_ptr<float>();
  const float* sin_p = sin_t.data_ptr<float>();

  // One parallel loop over (layer, position, head): layers may differ in strides, not in shape.
  const int64_t per_layer = n_pos * heads;
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / (2 * half));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, layers[0].scalar_type(), "rope_shift_cpu", [&] {
    struct Layer {
      scalar_t* base;
      int64_t s0, s1, s2, step, pair;
    };
    std::vector<Layer> ptrs;
    for (const at::Tensor& keys : layers) {
      const auto [step, pair] = pair_strides(keys, interleaved);
      ptrs.push_back({keys.data_ptr<scalar_t>(), keys.stride(0), keys.stride(1), keys.stride(2), step, pair});
    }
    at::parallel_for(0, per_layer * static_cast<int64_t>(ptrs.size()), grain, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const Layer& layer = ptrs[task / per_layer];
        const int64_t n = (task % per_layer) / heads, h = task % heads;
        scalar_t* x1 = layer.base + row[n] * layer.s0 + h * layer.s1 + col[n] * layer.s2;
        // A literal unit step lets the compiler vectorise the common dense layout.
        if (layer.step == 1) {
          rotate_pairs(x1, 1, layer.pair, cos_p + n * half, sin_p + n * half, half);
        } else {
          rotate_pairs(x1, layer.step, layer.pair, cos_p + n * half, sin_p + n * half, half);
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY(rig_decode, m) {
  m.def("rope_shift_layers_(Tensor(a!)[] layers, Tensor rows, Tensor cols, Tensor shift, Tensor inv_freq, "
        "bool interleaved=False) -> ()");
}

TORCH_LIBRARY_IMPL(rig_decode, CPU, m) {
  m.impl("rope_shift_layers_", &rope_shift_layers_cpu);
}

}  // namespace rig_decode

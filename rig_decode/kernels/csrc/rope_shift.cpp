// rig_decode::rope_shift_: rotate cached RoPE keys to new positions in place.
// The op schema, the argument checks shared with the CUDA kernel, and the CPU kernel.
// Semantics are those of rope_shift_ref_ in rig_decode/kernels/rope.py.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace rig_decode {

// Everything that can be checked without reading the indices (that is device-specific).
void check_rope_shift_args(const at::Tensor& keys, const at::Tensor& rows, const at::Tensor& cols,
                           const at::Tensor& shift, const at::Tensor& inv_freq) {
  TORCH_CHECK_VALUE(keys.dim() == 4, "rope_shift_: keys must be [batch, heads, columns, head_dim], got shape ",
                    keys.sizes());
  const auto dtype = keys.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf,
                   "rope_shift_: keys must be float32, float64, bfloat16 or float16, got ", dtype);
  const int64_t head_dim = keys.size(3);
  TORCH_CHECK_VALUE(head_dim % 2 == 0, "rope_shift_: head_dim must be even for RoPE, got ", head_dim);
  TORCH_CHECK_VALUE(inv_freq.numel() == head_dim / 2, "rope_shift_: inv_freq has ", inv_freq.numel(),
                    " entries; head_dim ", head_dim, " needs ", head_dim / 2);
  TORCH_CHECK_VALUE(rows.dim() == 1 && rows.sizes().equals(cols.sizes()) && rows.sizes().equals(shift.sizes()),
                    "rope_shift_: rows, cols and shift must be 1-D of one length, got ", rows.sizes(), ", ",
                    cols.sizes(), ", ", shift.sizes());
  TORCH_CHECK_TYPE(rows.scalar_type() == at::kLong && cols.scalar_type() == at::kLong,
                   "rope_shift_: rows and cols must be int64, got ", rows.scalar_type(), " and ", cols.scalar_type());
  TORCH_CHECK_TYPE(!shift.is_complex() && shift.scalar_type() != at::kBool,
                   "rope_shift_: shift must be a real number type, got ", shift.scalar_type());
  TORCH_CHECK_TYPE(at::isFloatingType(inv_freq.scalar_type()), "rope_shift_: inv_freq must be floating point, got ",
                   inv_freq.scalar_type());
  // Two elements sharing memory (an expanded view) would be rotated twice.
  at::assert_no_internal_overlap(keys);
}

namespace {

template <typename scalar_t>
inline void rotate_pairs(scalar_t* x1, int64_t stride, const float* cos_a, const float* sin_a, int64_t half) {
  scalar_t* x2 = x1 + half * stride;
  for (int64_t i = 0; i < half; ++i) {
    const float a = static_cast<float>(x1[i * stride]);
    const float b = static_cast<float>(x2[i * stride]);
    x1[i * stride] = static_cast<scalar_t>(a * cos_a[i] - b * sin_a[i]);
    x2[i * stride] = static_cast<scalar_t>(b * cos_a[i] + a * sin_a[i]);
  }
}

at::Tensor& rope_shift_cpu(at::Tensor& keys, const at::Tensor& rows, const at::Tensor& cols,
                           const at::Tensor& shift, const at::Tensor& inv_freq) {
  check_rope_shift_args(keys, rows, cols, shift, inv_freq);
  const int64_t n_pos = rows.numel();
  const int64_t batch = keys.size(0), heads = keys.size(1), columns = keys.size(2), half = keys.size(3) / 2;
  const at::Tensor rows_c = rows.contiguous(), cols_c = cols.contiguous();
  const int64_t* row = rows_c.data_ptr<int64_t>();
  const int64_t* col = cols_c.data_ptr<int64_t>();
  // All indices are checked before the first write, so a bad call leaves keys untouched.
  for (int64_t n = 0; n < n_pos; ++n) {
    TORCH_CHECK_INDEX(row[n] >= 0 && row[n] < batch && col[n] >= 0 && col[n] < columns,
                      "rope_shift_: (row, column) index (", row[n], ", ", col[n], ") at position ", n,
                      " is outside keys of shape ", keys.sizes());
  }
  if (n_pos == 0 || heads == 0 || half == 0) {
    return keys;
  }

  // The same torch ops as the reference, so the angles' cos and sin match it bit for bit.
  const at::Tensor angle = shift.to(at::kFloat).unsqueeze(1) * inv_freq.to(at::kFloat).reshape({1, half});
  const at::Tensor cos_t = angle.cos().contiguous(), sin_t = angle.sin().contiguous();
  const float* cos_p = cos_t.data_ptr<float>();
  const float* sin_p = sin_t.data_ptr<float>();

  const int64_t s0 = keys.stride(0), s1 = keys.stride(1), s2 = keys.stride(2), s3 = keys.stride(3);
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / (2 * half));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, keys.scalar_type(), "rope_shift_cpu", [&] {
    scalar_t* base = keys.data_ptr<scalar_t>();
    at::parallel_for(0, n_pos * heads, grain, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t n = task / heads, h = task % heads;
        scalar_t* x1 = base + row[n] * s0 + h * s1 + col[n] * s2;
        // A literal unit stride lets the compiler vectorise the common dense layout.
        if (s3 == 1) {
          rotate_pairs(x1, 1, cos_p + n * half, sin_p + n * half, half);
        } else {
          rotate_pairs(x1, s3, cos_p + n * half, sin_p + n * half, half);
        }
      }
    });
  });
  return keys;
}

}  // namespace

TORCH_LIBRARY(rig_decode, m) {
  m.def("rope_shift_(Tensor(a!) keys, Tensor rows, Tensor cols, Tensor shift, Tensor inv_freq) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(rig_decode, CPU, m) {
  m.impl("rope_shift_", &rope_shift_cpu);
}

}  // namespace rig_decode

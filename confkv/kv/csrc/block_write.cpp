// Writes new entries into a block pool's rows on CPU: each head vector cast or quantised, packed with its
// fp16 parameters and stored in its row, byte for byte as Codec.encode and Codec.pack do it in
// confkv/kv/block_pool.py (the tests compare the two). One call per layer and pool replaces a dozen
// small torch operations, which cost more than the attention of a decode step.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "formats.h"

namespace {

constexpr int64_t kGrain = 64;  // vectors per task: a decode step's few are not worth waking threads for

// What torch's clamp and uint8/int8 cast give: NaN (0 / 0 from a constant vector) becomes 0.
inline float clamp_code(float code, float low, float high) {
  code = code > low ? code : low;
  return code < high ? code : high;
}

inline void store_half(uint8_t* out, float value) {
  const uint16_t bits = c10::Half(value).x;
  std::memcpy(out, &bits, sizeof bits);
}

// int8: symmetric, scale = absmax / 127 (the codes use it in float32, the row keeps it in fp16).
void encode_int8(const float* v, int64_t dim, uint8_t* out) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < dim; ++i) absmax = std::max(absmax, std::fabs(v[i]));
  const float scale = std::max(absmax, 1e-8f) / 127.0f;
  for (int64_t i = 0; i < dim; ++i) {
    const auto code = static_cast<int8_t>(clamp_code(std::nearbyint(v[i] / scale), -127.0f, 127.0f));
    std::memcpy(out + i, &code, 1);
  }
  store_half(out + dim, scale);
}

// int4, int2: asymmetric, the parameters rounded to fp16 before the codes are taken with them; byte i
// holds dimensions i, i + dim / k, ... (k codes per byte) from its lowest bits up.
void encode_packed(const float* v, int64_t dim, int bits, uint8_t* out) {
  const float levels = static_cast<float>((1 << bits) - 1);
  float lo = v[0], hi = v[0];
  for (int64_t i = 1; i < dim; ++i) {
    lo = std::min(lo, v[i]);
    hi = std::max(hi, v[i]);
  }
  lo += 0.0f;  // -0.0 as 0.0, as `quantize` stores it (which zero a min keeps depends on its order)
  const c10::Half scale(std::max((hi - lo) / levels, 1e-8f)), minimum(lo);
  const float s = scale, m = minimum;
  const int64_t parts = 8 / bits, width = dim / parts;
  for (int64_t i = 0; i < width; ++i) {
    uint32_t byte = 0;
    for (int64_t k = 0; k < parts; ++k) {
      const float code = clamp_code(std::nearbyint((v[i + k * width] - m) / s), 0.0f, levels);
      byte |= static_cast<uint32_t>(code) << (k * bits);
    }
    out[i] = static_cast<uint8_t>(byte);
  }
  std::memcpy(out + width, &scale.x, 2);
  std::memcpy(out + width + 2, &minimum.x, 2);
}

void encode_vector(const float* v, int64_t dim, int64_t format, uint8_t* out) {
  switch (format) {
    case kFloat32:
      std::memcpy(out, v, dim * sizeof(float));
      return;
    case kFloat16:
      for (int64_t i = 0; i < dim; ++i) store_half(out + 2 * i, v[i]);
      return;
    case kBFloat16:
      for (int64_t i = 0; i < dim; ++i) {
        const uint16_t bits = c10::BFloat16(v[i]).x;
        std::memcpy(out + 2 * i, &bits, 2);
      }
      return;
    case kInt8:
      return encode_int8(v, dim, out);
    default:
      return encode_packed(v, dim, format == kInt4 ? 4 : 2, out);
  }
}

// Bytes of a vector's row: its codes (or elements), then its fp16 parameters.
int64_t row_bytes(int64_t format, int64_t dim) {
  switch (format) {
    case kFloat32:
      return 4 * dim;
    case kFloat16:
    case kBFloat16:
      return 2 * dim;
    case kInt8:
      return dim + 2;
    case kInt4:
      return dim / 2 + 4;
    default:
      return dim / 4 + 4;
  }
}

template <typename T>
void encode_all(const at::Tensor& x, const int64_t* rows, uint8_t* data, int64_t format, int64_t vector_bytes) {
  const int64_t n = x.size(0), heads = x.size(1), dim = x.size(2);
  const int64_t s0 = x.stride(0), s1 = x.stride(1), s2 = x.stride(2);
  const T* base = x.data_ptr<T>();
  at::parallel_for(0, n * heads, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> v(dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / heads, h = item % heads;
      const T* src = base + t * s0 + h * s1;
      for (int64_t i = 0; i < dim; ++i) v[i] = static_cast<float>(src[i * s2]);
      encode_vector(v.data(), dim, format, data + (rows[t] * heads + h) * vector_bytes);
    }
  });
}

}  // namespace

void encode_rows(const at::Tensor& x, const at::Tensor& rows, at::Tensor& data, int64_t format) {
  TORCH_CHECK(format >= kFloat32 && format <= kInt2, "encode_rows: format ", format,
              " is not written by rows (int4c keys are written by whole blocks)");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3, "x must be a CPU tensor [n, kv_heads, head_dim]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "x must be float32, float16 or bfloat16");
  const int64_t n = x.size(0), heads = x.size(1), dim = x.size(2);
  const int64_t parts = format == kInt4 ? 2 : format == kInt2 ? 4 : 1;
  TORCH_CHECK(dim % parts == 0, "head_dim ", dim, " must be a multiple of ", parts, " for this format");
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.size(0) == n,
              "rows must be a CPU int64 tensor [n]");
  TORCH_CHECK(data.device().is_cpu() && data.is_contiguous() && data.dim() == 4 && data.size(2) == heads,
              "data must be a contiguous CPU tensor [blocks, block_size, ", heads, ", row]");
  const int64_t vector_bytes = data.size(3) * data.element_size();
  TORCH_CHECK(vector_bytes == row_bytes(format, dim), "data rows have ", vector_bytes, " bytes, the format needs ",
              row_bytes(format, dim));
  const at::Tensor index = rows.contiguous();
  const int64_t* r = index.data_ptr<int64_t>();
  const int64_t entries = data.size(0) * data.size(1);
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(r[t] >= 0 && r[t] < entries, "row ", r[t], " lies outside the pool's ", entries, " rows");
  }
  auto* bytes = static_cast<uint8_t*>(data.data_ptr());
  if (x.scalar_type() == at::kFloat) {
    encode_all<float>(x, r, bytes, format, vector_bytes);
  } else if (x.scalar_type() == at::kHalf) {
    encode_all<c10::Half>(x, r, bytes, format, vector_bytes);
  } else {
    encode_all<c10::BFloat16>(x, r, bytes, format, vector_bytes);
  }
}

// The 1-bit allreduce's passes fused for CPUs: one loop over the rows per pass, each row read from
// memory once (a row of at most 4096 fp32 stays in L1/L2 between its reduction and its update).
// Built at first use by zoa_train/comm/kernels/native.py; the arithmetic is that of the torch path
// (zoa_train/comm/kernels/torch_ops.py) operation for operation, except the row's sum of squares,
// which is accumulated in double in its own order.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Where row r of a pass keeps its packed signs and its scale: row r % rows of chunk r / rows, a
// chunk's signs and scales `sign_stride` bytes and `scale_stride` floats after the previous chunk's.
struct Wire {
  uint8_t* signs;
  int64_t sign_stride;
  float* scales;
  int64_t scale_stride;
  int64_t rows;
  int64_t row;
  uint8_t* row_signs(int64_t r) const { return signs + (r / rows) * sign_stride + (r % rows) * (row / 8); }
  float* row_scale(int64_t r) const { return scales + (r / rows) * scale_stride + r % rows; }
};

Wire wire(const torch::Tensor& signs, const torch::Tensor& scales, int64_t rows, int64_t row) {
  TORCH_CHECK(signs.dtype() == torch::kUInt8 && signs.dim() == 2 && signs.stride(1) == 1, "signs: (chunks, bytes) uint8");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.dim() == 2 && scales.stride(1) == 1, "scales: (chunks, rows) float32");
  return {signs.data_ptr<uint8_t>(), signs.stride(0), scales.data_ptr<float>(), scales.stride(0), rows, row};
}

// Rows processed per task: a few hundred KB of data, enough to amortise a thread hand-off.
int64_t grain(int64_t row) { return std::max<int64_t>(1, (1 << 16) / row); }

double sum_of_squares(const float* y, int64_t count) {
  int64_t j = 0;
  double total = 0.0;
#if defined(__AVX2__)
  __m256d lanes[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  for (; j + 16 <= count; j += 16) {
    for (int k = 0; k < 4; ++k) {
      const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(y + j + 4 * k));
      lanes[k] = _mm256_add_pd(lanes[k], _mm256_mul_pd(v, v));
    }
  }
  alignas(32) double parts[4];
  _mm256_store_pd(parts, _mm256_add_pd(_mm256_add_pd(lanes[0], lanes[1]), _mm256_add_pd(lanes[2], lanes[3])));
  total = (parts[0] + parts[1]) + (parts[2] + parts[3]);
#endif
  for (; j < count; ++j) total += static_cast<double>(y[j]) * y[j];
  return total;
}

#if defined(__AVX2__)
// Eight lanes, lane k all ones where bit k of `byte` is set.
inline __m256 bit_lanes(uint8_t byte) {
  const __m256i select = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(byte), select), select));
}
#endif

// Eight elements -> their sign bits (bit k: y[k] >= 0; NaN gives 0) and their errors in place:
// y + s - 2s where y >= 0, y + s elsewhere (the torch path's y + s - 2*s*flag), zero where not finite.
inline uint8_t compress8(float* y, float s, float two_s) {
#if defined(__AVX2__)
  const __m256 v = _mm256_loadu_ps(y);
  const __m256 ge = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ);
  const __m256 t = _mm256_add_ps(v, _mm256_set1_ps(s));
  __m256 e = _mm256_sub_ps(t, _mm256_and_ps(ge, _mm256_set1_ps(two_s)));
  // finite <=> |e| <= FLT_MAX (false for inf and NaN)
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), e);
  e = _mm256_and_ps(e, _mm256_cmp_ps(magnitude, _mm256_set1_ps(3.4028234663852886e38f), _CMP_LE_OQ));
  _mm256_storeu_ps(y, e);
  return static_cast<uint8_t>(_mm256_movemask_ps(ge));
#else
  unsigned byte = 0;
  for (int k = 0; k < 8; ++k) {
    const bool flag = y[k] >= 0.0f;
    byte |= static_cast<unsigned>(flag) << k;
    const float t = y[k] + s;
    const float e = flag ? t - two_s : t;
    y[k] = std::isfinite(e) ? e : 0.0f;
  }
  return static_cast<uint8_t>(byte);
#endif
}

// One row of y (its first `valid` elements real, the rest padding, taken as zero): s = RMS over the
// real elements, the signs packed (bit k of byte q is element 8q+k >= 0: padding's bits are set, as
// sign(0) = +1), y <- y - s*sign(y) with padding's error zero.
inline void compress_row(float* y, int64_t row, int64_t valid, float norm, uint8_t* signs, float* scale) {
  std::memset(y + valid, 0, sizeof(float) * (row - valid));
  const float s = static_cast<float>(std::sqrt(sum_of_squares(y, valid))) / norm;
  const float two_s = 2.0f * s;
  for (int64_t q = 0; q < row / 8; ++q) signs[q] = compress8(y + 8 * q, s, two_s);
  std::memset(y + valid, 0, sizeof(float) * (row - valid));  // the residual left -s there
  *scale = s;
}

template <typename T>
void add_row(float* y, const T* addend, int64_t count) {
  int64_t j = 0;
#if defined(__AVX2__)
  if constexpr (std::is_same_v<T, float>)
    for (; j + 8 <= count; j += 8) _mm256_storeu_ps(y + j, _mm256_add_ps(_mm256_loadu_ps(y + j), _mm256_loadu_ps(addend + j)));
#endif
  for (; j < count; ++j) y[j] += static_cast<float>(addend[j]);
}

// Worker pass: y = values (+ addend) per row of values (R, row), compressed into the wire; values
// then hold the error.
void compress(torch::Tensor values, c10::optional<torch::Tensor> addend, torch::Tensor valid, torch::Tensor norm, torch::Tensor signs,
              torch::Tensor scales) {
  TORCH_CHECK(values.dtype() == torch::kFloat32 && values.is_contiguous() && values.dim() == 3, "values: contiguous (chunks, rows, row) float32");
  const int64_t rows = values.size(1), row = values.size(2), total = values.size(0) * rows;
  TORCH_CHECK(row % 8 == 0 && valid.numel() == total && norm.numel() == total, "valid, norm: one per row");
  const Wire w = wire(signs, scales, rows, row);
  float* y = values.data_ptr<float>();
  const int32_t* v = valid.data_ptr<int32_t>();
  const float* nm = norm.data_ptr<float>();
  TORCH_CHECK(!addend.has_value() || (addend->is_contiguous() && addend->numel() == values.numel()), "addend: contiguous, one per element");
  at::parallel_for(0, total, grain(row), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      if (addend.has_value()) {  // row by row, so the row is still in cache for its compression
        const torch::Tensor& a = *addend;
        if (a.scalar_type() == torch::kFloat32) add_row(y + r * row, a.data_ptr<float>() + r * row, v[r]);
        else if (a.scalar_type() == torch::kBFloat16) add_row(y + r * row, a.data_ptr<c10::BFloat16>() + r * row, v[r]);
        else add_row(y + r * row, a.data_ptr<c10::Half>() + r * row, v[r]);
      }
      compress_row(y + r * row, row, v[r], nm[r], w.row_signs(r), w.row_scale(r));
    }
  });
}

// Server pass over this rank's rows of server (1, rows, row): c = server + sum_i (2*s_i/n)*flag_i -
// sum_i s_i/n (sign = 2*flag - 1), the sources added in order as the torch path does, then
// compressed as the worker's y into `mine`.
void server(torch::Tensor recv_signs, torch::Tensor recv_scales, double two_over_n, torch::Tensor values, torch::Tensor valid, torch::Tensor norm,
            torch::Tensor signs, torch::Tensor scales) {
  TORCH_CHECK(values.dtype() == torch::kFloat32 && values.is_contiguous() && values.dim() == 3, "values: contiguous (1, rows, row) float32");
  const int64_t rows = values.size(1), row = values.size(2), sources = recv_signs.size(0);
  const Wire in = wire(recv_signs, recv_scales, rows, row), out = wire(signs, scales, rows, row);
  float* c = values.data_ptr<float>();
  const int32_t* v = valid.data_ptr<int32_t>();
  const float* nm = norm.data_ptr<float>();
  const float factor = static_cast<float>(two_over_n);
  at::parallel_for(0, rows, grain(row), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      float* y = c + r * row;
      float coef_sum = 0.0f;
      for (int64_t i = 0; i < sources; ++i) {
        const float coef = in.scales[i * in.scale_stride + r] * factor;
        coef_sum += coef;
        const uint8_t* bytes = in.signs + i * in.sign_stride + r * (row / 8);
        int64_t q = 0;
#if defined(__AVX2__)
        // flag*coef as coef masked by the flag: the same sum where coef is finite (flag 0 adds +0)
        if (std::isfinite(coef)) {
          const __m256 spread = _mm256_set1_ps(coef);
          for (; q < row / 8; ++q)
            _mm256_storeu_ps(y + 8 * q, _mm256_add_ps(_mm256_loadu_ps(y + 8 * q), _mm256_and_ps(bit_lanes(bytes[q]), spread)));
        }
#endif
        for (; q < row / 8; ++q)
          for (int k = 0; k < 8; ++k) y[8 * q + k] += static_cast<float>((bytes[q] >> k) & 1) * coef;
      }
      const float mean = coef_sum * 0.5f;
      for (int64_t j = 0; j < row; ++j) y[j] -= mean;
      compress_row(y, row, v[r], nm[r], out.row_signs(r), out.row_scale(r));
    }
  });
}

// Bit k of byte b as the sign bit of an fp32 word: XORed into a positive scale it gives -scale.
struct SignMasks {
  uint32_t mask[256][8];
  SignMasks() {
    for (int b = 0; b < 256; ++b)
      for (int k = 0; k < 8; ++k) mask[b][k] = ((b >> k) & 1) ? 0u : 0x80000000u;
  }
};
const SignMasks kSignMasks;

inline void signs_times(const uint8_t* bytes, float s, int64_t count, float* out) {
  int64_t q = 0;
#if defined(__AVX2__)
  const __m256 plus = _mm256_set1_ps(s), minus = _mm256_set1_ps(-s);
  for (; q < count / 8; ++q) _mm256_storeu_ps(out + 8 * q, _mm256_blendv_ps(minus, plus, bit_lanes(bytes[q])));
#endif
  uint32_t bits;
  std::memcpy(&bits, &s, 4);
  for (; q < count / 8; ++q) {
    const uint32_t* mask = kSignMasks.mask[bytes[q]];
    for (int k = 0; k < 8; ++k) {
      const uint32_t word = bits ^ mask[k];
      std::memcpy(out + 8 * q + k, &word, 4);
    }
  }
}

#if defined(__AVX2__)
// A row's output, padding (from `valid` on) zero, into 32-byte aligned memory with non-temporal
// stores: the output is far larger than the caches and written whole, so this saves reading each
// line before writing it (half the traffic).
inline void output_row_streamed(const uint8_t* bytes, float s, int64_t count, int64_t valid, float* out) {
  const __m256 plus = _mm256_set1_ps(s), minus = _mm256_set1_ps(-s);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t q = 0; q < count / 8; ++q) {
    __m256 value = _mm256_blendv_ps(minus, plus, bit_lanes(bytes[q]));
    if (8 * q + 8 > valid) {
      const int32_t real = static_cast<int32_t>(std::max<int64_t>(0, valid - 8 * q));
      value = _mm256_and_ps(value, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(real), lane)));
    }
    _mm256_stream_ps(out + 8 * q, value);
  }
}
#endif

template <typename T>
void output_rows(const Wire& w, const int32_t* v, T* out, int64_t first, int64_t last) {
  const int64_t row = w.row;
  float staged[8];
  for (int64_t r = first; r < last; ++r) {
    T* o = out + r * row;
    const uint8_t* bytes = w.row_signs(r);
    const float s = *w.row_scale(r);
    if constexpr (std::is_same_v<T, float>) {
#if defined(__AVX2__)
      if (reinterpret_cast<uintptr_t>(o) % 32 == 0) {
        output_row_streamed(bytes, s, row, v[r], o);
        continue;
      }
#endif
      signs_times(bytes, s, row, o);
    } else {
      for (int64_t q = 0; q < row / 8; ++q) {
        signs_times(bytes + q, s, 8, staged);
        for (int k = 0; k < 8; ++k) o[8 * q + k] = static_cast<T>(staged[k]);
      }
    }
    for (int64_t j = v[r]; j < row; ++j) o[j] = static_cast<T>(0.0f);
  }
#if defined(__AVX2__)
  _mm_sfence();  // the streamed stores are visible before the pass returns
#endif
}

// Output pass: the gathered signs of every chunk times their row scales into out (R, row), padding zero.
void decompress(torch::Tensor signs, torch::Tensor scales, torch::Tensor valid, torch::Tensor out) {
  TORCH_CHECK(out.is_contiguous() && out.dim() == 3, "out: contiguous (chunks, rows, row)");
  const int64_t rows = out.size(1), row = out.size(2), total = out.size(0) * rows;
  const Wire w = wire(signs, scales, rows, row);
  const int32_t* v = valid.data_ptr<int32_t>();
  at::parallel_for(0, total, grain(row), [&](int64_t first, int64_t last) {
    switch (out.scalar_type()) {
      case torch::kFloat32: output_rows(w, v, out.data_ptr<float>(), first, last); break;
      case torch::kBFloat16: output_rows(w, v, out.data_ptr<c10::BFloat16>(), first, last); break;
      case torch::kHalf: output_rows(w, v, out.data_ptr<c10::Half>(), first, last); break;
      default: TORCH_CHECK(false, "out: float32, bfloat16 or float16");
    }
  });
}

// pack_signs / unpack_signs (zoa_train/comm/packing.py) for fp32 on CPU: 8 signs per byte.
void pack(torch::Tensor x, torch::Tensor out) {
  const float* p = x.data_ptr<float>();
  uint8_t* o = out.data_ptr<uint8_t>();
  const int64_t n = x.numel();
  at::parallel_for(0, n / 8, 1 << 14, [&](int64_t first, int64_t last) {
    for (int64_t q = first; q < last; ++q) {
#if defined(__AVX2__)
      o[q] = static_cast<uint8_t>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + 8 * q), _mm256_setzero_ps(), _CMP_GE_OQ)));
#else
      unsigned byte = 0;
      for (int k = 0; k < 8; ++k) byte |= static_cast<unsigned>(p[8 * q + k] >= 0.0f) << k;
      o[q] = static_cast<uint8_t>(byte);
#endif
    }
  });
  if (n % 8) {  // the last byte's missing elements count as +1
    unsigned byte = 0xFFu;
    for (int64_t k = 0; k < n % 8; ++k) byte &= ~(static_cast<unsigned>(!(p[n - n % 8 + k] >= 0.0f)) << k);
    o[n / 8] = static_cast<uint8_t>(byte);
  }
}

void unpack(torch::Tensor packed, double scale, torch::Tensor out) {
  const uint8_t* b = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t n = out.numel();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, n / 8, 1 << 14, [&](int64_t first, int64_t last) { signs_times(b + first, s, 8 * (last - first), o + 8 * first); });
  for (int64_t j = n - n % 8; j < n; ++j) o[j] = ((b[j / 8] >> (j % 8)) & 1) ? s : -s;
}

// 0/1 Adam's end of a sync (zoa_train/optim/zero_one_adam.py, _finish_sync) in one pass over m (w_bar on
// entry), the anchor and the denominator d, in the torch ops' arithmetic and order:
//   md = nan_to_num(w_bar * d, 0, 0, 0);  anchor = anchor * decay + (-1 * md) / d;  m = md / lr_sum
// and the parameters (fp32, contiguous, at ascending `offsets` in the flat layout) copied from the
// new anchor while its block is still in cache.
void finish_sync(torch::Tensor m, torch::Tensor anchor, torch::Tensor denom, double decay, double lr_sum, std::vector<torch::Tensor> params,
                 std::vector<int64_t> offsets) {
  const int64_t n = m.numel();
  for (const auto* t : {&m, &anchor, &denom})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == torch::kFloat32 && t->numel() == n, "m, anchor, denom: contiguous float32 of one size");
  TORCH_CHECK(params.size() == offsets.size(), "one offset per parameter");
  std::vector<float*> targets;
  std::vector<int64_t> sizes;
  for (size_t k = 0; k < params.size(); ++k) {
    TORCH_CHECK(params[k].is_contiguous() && params[k].scalar_type() == torch::kFloat32, "parameters: contiguous float32");
    TORCH_CHECK(offsets[k] >= (k ? offsets[k - 1] + sizes[k - 1] : 0) && offsets[k] + params[k].numel() <= n, "offsets: ascending, inside the flat buffer");
    targets.push_back(params[k].data_ptr<float>());
    sizes.push_back(params[k].numel());
  }
  float* mp = m.data_ptr<float>();
  float* ap = anchor.data_ptr<float>();
  const float* dp = denom.data_ptr<float>();
  const bool scale = decay != 1.0, divide = lr_sum > 0;
  const float f_decay = static_cast<float>(decay), f_lr = static_cast<float>(lr_sum);
  at::parallel_for(0, n, 1 << 14, [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j) {
      float md = mp[j] * dp[j];
      md = std::fabs(md) <= std::numeric_limits<float>::max() ? md : 0.0f;
      const float a = scale ? ap[j] * f_decay : ap[j];
      ap[j] = a + (-1.0f * md) / dp[j];
      mp[j] = divide ? md / f_lr : md;
    }
    // the parameters that meet [first, last): the first is the last to start at or before `first`
    int64_t k = std::upper_bound(offsets.begin(), offsets.end(), first) - offsets.begin();
    for (k = std::max<int64_t>(k - 1, 0); k < static_cast<int64_t>(offsets.size()) && offsets[k] < last; ++k) {
      const int64_t lo = std::max(first, offsets[k]), hi = std::min(last, offsets[k] + sizes[k]);
      if (lo < hi) std::memcpy(targets[k] + (lo - offsets[k]), ap + lo, sizeof(float) * (hi - lo));
    }
  });
}

}  // namespace

// The passes touch tensors only, never Python objects: they let go of the GIL, so that a collective's
// background thread (zoa_train/comm/buckets.py) compresses while backward runs Python hooks.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto free = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("compress", &compress, free);
  m.def("server", &server, free);
  m.def("decompress", &decompress, free);
  m.def("pack", &pack, free);
  m.def("unpack", &unpack, free);
  m.def("finish_sync", &finish_sync, free);
}

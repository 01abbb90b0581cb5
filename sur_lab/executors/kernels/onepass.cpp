// One-pass packed attention on the CPU (appendix 13.2, Eq. 22-24): every K/V tile is read once for all the packed
// rows that see it.
//
// Packed row r (sorted absolute position u_r) attends keys 0..u_r. The GQA group is folded into the query rows in
// (row, group) order, so the g query heads that share a KV head form one block of B * g rows. Keys are visited in
// tiles [k0, k1) given by the plan (sur_lab.executors.kernels.onepass.build_onepass_plan): the rows that visit a
// tile are those with u_r >= k0, a suffix of the sorted rows; among them those with u_r >= k1 - 1 see it whole
// (complete tile, no per-element test, Eq. 23) and the others only keys j <= u_r (Eq. 22, 24). For each tile the
// kernel computes the scores of all visiting rows with one GEMM, updates their online-softmax state (running max m,
// sum l, FP32 accumulator; Dao et al. 2022) and adds P V with a second GEMM, so the tile's keys and values are read
// from memory once per KV head (per row chunk when the rows do not fit in cache) instead of once per query block as in
// torch's CPU flash kernel.
//
// dtypes: float32, bfloat16 and float16 compute in float32 (16-bit K/V tiles and Q are widened once; the output is
// rounded once), float64 in float64 (the exactness tests). GEMMs go to the BLAS that torch links (sgemm_ / dgemm_, MKL or
// OpenBLAS); exponentials use a vectorised Cephes expf (~1 ulp) in float32, std::exp in float64. Threads: ATen's
// parallel_for (OpenMP) over (KV head, row chunk).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}

namespace {

// Column-major BLAS on row-major buffers: a row-major X [r x c] is the column-major X^T.
void blas_gemm(const char* ta, const char* tb, int m, int n, int k, float alpha, const float* a, int lda,
               const float* b, int ldb, float beta, float* c, int ldc) {
  sgemm_(ta, tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}
void blas_gemm(const char* ta, const char* tb, int m, int n, int k, double alpha, const double* a, int lda,
               const double* b, int ldb, double beta, double* c, int ldc) {
  dgemm_(ta, tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

// Row-major S [m x n] = A [m x k] * B^T, B row-major [n x k]: column-major S^T = B * A^T.
template <typename T>
void gemm_abt(int m, int n, int k, const T* a, int lda, const T* b, int ldb, T* s, int lds) {
  blas_gemm("T", "N", n, m, k, T(1), b, ldb, a, lda, T(0), s, lds);
}

// Row-major C [m x d] += P [m x n] * V [n x d]: column-major C^T += V^T * P^T.
template <typename T>
void gemm_acc(int m, int d, int n, const T* p, int ldp, const T* v, int ldv, T* c, int ldc) {
  blas_gemm("N", "N", d, m, n, T(1), v, ldv, p, ldp, T(1), c, ldc);
}

// ---- float32 row helpers (GCC/Clang vector extensions: one AVX-512 register, two AVX2 or four SSE registers) ----

typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));
constexpr int W = 16;

inline v16f load16(const float* p) {
  v16f x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
inline void store16(float* p, v16f x) { std::memcpy(p, &x, sizeof(x)); }
inline v16f splat(float x) { return v16f{} + x; }

// exp(x) for x <= 0 (scores minus their row max): Cephes expf, range reduction x = n ln2 + r, |r| <= ln2 / 2, a
// degree-6 polynomial for e^r (relative error ~1e-7), 2^n built in the exponent bits. x is clamped at -87 (2^-126,
// the smallest normal): those terms are below FP32 resolution of a sum that holds a 1.
inline v16f exp16(v16f x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  v16f t = x * 1.44269504088896341f - 0.5f;  // x <= 0: truncation toward zero of (x log2 e - 1/2) rounds to nearest
  v16i n = __builtin_convertvector(t, v16i);
  v16f nf = __builtin_convertvector(n, v16f);
  v16f r = x - nf * 0.693359375f + nf * 2.12194440e-4f;  // ln 2 = 0.693359375 - 2.12194440e-4 (Cody-Waite)
  v16f p = splat(1.9875691500E-4f);
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r * r + r + 1.0f;
  v16i bits = (n + 127) << 23;
  v16f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float row_max(const float* s, int n) {
  float m = -std::numeric_limits<float>::infinity();
  int j = 0;
  if (n >= W) {
    v16f mv = load16(s);
    for (j = W; j + W <= n; j += W) {
      v16f x = load16(s + j);
      mv = x > mv ? x : mv;
    }
    for (int i = 0; i < W; ++i) m = std::max(m, mv[i]);
  }
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

// p_j = exp(s_j - m) in place for j < n; returns their sum (FP32, W partial sums).
inline float exp_sum(float* s, int n, float m) {
  v16f acc{};
  int j = 0;
  for (; j + W <= n; j += W) {
    v16f p = exp16(load16(s + j) - m);
    store16(s + j, p);
    acc += p;
  }
  float sum = 0.0f;
  for (int i = 0; i < W; ++i) sum += acc[i];
  if (j < n) {
    float tail[W];
    int rest = n - j;
    for (int i = 0; i < W; ++i) tail[i] = i < rest ? s[j + i] - m : -87.0f;
    v16f p = exp16(load16(tail));
    for (int i = 0; i < rest; ++i) {
      s[j + i] = p[i];
      sum += p[i];
    }
  }
  return sum;
}

inline void scale_row(float* x, int d, float alpha) {
  int j = 0;
  for (; j + W <= d; j += W) store16(x + j, load16(x + j) * alpha);
  for (; j < d; ++j) x[j] *= alpha;
}

// ---- float64 row helpers (tests: plain loops, std::exp) ----

inline double row_max(const double* s, int n) {
  double m = -std::numeric_limits<double>::infinity();
  for (int j = 0; j < n; ++j) m = std::max(m, s[j]);
  return m;
}
inline double exp_sum(double* s, int n, double m) {
  double sum = 0.0;
  for (int j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
}
inline void scale_row(double* x, int d, double alpha) {
  for (int j = 0; j < d; ++j) x[j] *= alpha;
}

// One (KV head, row chunk) work item. scalar_t: the tensors' dtype; acc_t: compute dtype (float or double).
template <typename scalar_t, typename acc_t>
void attend_chunk(const scalar_t* q, int64_t q_sh, int64_t q_sr,  // q [Hq, B, d] strides (head, row); d contiguous
                  const scalar_t* k, int64_t k_sr,                  // this KV head's keys, row stride; d contiguous
                  const scalar_t* v, int64_t v_sr,
                  scalar_t* out, int64_t o_sr, int64_t o_sh,  // out [B, Hq, d]: row stride, head stride
                  const int64_t* pos, const int64_t* bounds, int64_t num_tiles, int64_t kv_head, int64_t group,
                  int64_t r0, int64_t r1, int64_t d, acc_t scale) {
  const int64_t rows = (r1 - r0) * group;  // folded rows of this chunk, (row, group) order
  // The largest score tile of this chunk: visiting rows shrink as tiles advance while tiles grow.
  int64_t score_size = 0, tile_keys = 0;
  for (int64_t t = 0, first = r0; t < num_tiles; ++t) {
    while (first < r1 && pos[first] < bounds[t]) ++first;
    if (first >= r1) break;
    score_size = std::max(score_size, (r1 - first) * group * (bounds[t + 1] - bounds[t]));
    tile_keys = std::max(tile_keys, bounds[t + 1] - bounds[t]);
  }
  // Scratch that is fully written before it is read is left uninitialised (no per-layer memset of the score tile);
  // the accumulator must start at 0 (its first rescale multiplies it by 0).
  std::unique_ptr<acc_t[]> qf(new acc_t[rows * d]), scores(new acc_t[std::max<int64_t>(score_size, 1)]);
  std::vector<acc_t> acc(rows * d, acc_t(0)), mx(rows, -std::numeric_limits<acc_t>::infinity()), sum(rows, acc_t(0));
  constexpr bool widen = !std::is_same<scalar_t, acc_t>::value;
  std::unique_ptr<acc_t[]> kt(new acc_t[widen ? tile_keys * d : 1]), vt(new acc_t[widen ? tile_keys * d : 1]);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t g = 0; g < group; ++g) {
      const scalar_t* src = q + (kv_head * group + g) * q_sh + r * q_sr;
      acc_t* dst = qf.get() + ((r - r0) * group + g) * d;
      for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<acc_t>(src[c]) * scale;  // the softmax scale, once
    }
  }
  int64_t first = r0;  // first row of the chunk that visits the current tile (u_r >= k0); nondecreasing in k0
  for (int64_t t = 0; t < num_tiles; ++t) {
    const int64_t k0 = bounds[t], k1 = bounds[t + 1], n = k1 - k0;
    while (first < r1 && pos[first] < k0) ++first;
    if (first >= r1) break;  // later tiles start later still: no row of this chunk visits them
    const acc_t* kp;
    const acc_t* vp;
    int64_t ldk, ldv;
    if constexpr (widen) {  // bfloat16 / float16: widen the tile once, for every row that visits it
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t c = 0; c < d; ++c) {
          kt[j * d + c] = static_cast<acc_t>(k[(k0 + j) * k_sr + c]);
          vt[j * d + c] = static_cast<acc_t>(v[(k0 + j) * v_sr + c]);
        }
      }
      kp = kt.get();
      vp = vt.get();
      ldk = ldv = d;
    } else {
      kp = reinterpret_cast<const acc_t*>(k + k0 * k_sr);
      vp = reinterpret_cast<const acc_t*>(v + k0 * v_sr);
      ldk = k_sr;
      ldv = v_sr;
    }
    const int64_t f0 = (first - r0) * group;  // first visiting folded row
    const int64_t m_rows = rows - f0;
    acc_t* s = scores.get();  // [m_rows, n], leading dimension n
    gemm_abt<acc_t>(m_rows, n, d, qf.get() + f0 * d, d, kp, ldk, s, n);
    for (int64_t f = f0; f < rows; ++f) {
      const int64_t r = r0 + f / group;
      acc_t* srow = s + (f - f0) * n;
      // Complete tile for rows with u_r >= k1 - 1; otherwise only keys k0..u_r (at least one: u_r >= k0).
      const int64_t visible = std::min<int64_t>(n, pos[r] - k0 + 1);
      const acc_t m_new = std::max(mx[f], row_max(srow, visible));
      const acc_t alpha = std::exp(mx[f] - m_new);  // 0 on the row's first tile (mx = -inf)
      const acc_t p_sum = exp_sum(srow, visible, m_new);
      for (int64_t j = visible; j < n; ++j) srow[j] = acc_t(0);  // masked keys carry no weight
      sum[f] = sum[f] * alpha + p_sum;
      mx[f] = m_new;
      if (alpha != acc_t(1)) scale_row(acc.data() + f * d, d, alpha);
    }
    gemm_acc<acc_t>(m_rows, d, n, s, n, vp, ldv, acc.data() + f0 * d, d);
  }
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t f = (r - r0) * group + g;
      const acc_t inv = acc_t(1) / sum[f];
      scalar_t* dst = out + r * o_sr + (kv_head * group + g) * o_sh;
      const acc_t* src = acc.data() + f * d;
      for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<scalar_t>(src[c] * inv);
    }
  }
}

at::Tensor onepass_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& positions, const at::Tensor& bounds, double scale,
                             int64_t max_chunk_rows) {
  // Shapes, dtypes and the plan are validated in Python (sur_lab.executors.kernels.onepass); these checks guard the
  // memory accesses only.
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == 1, "q, k, v must be [1, heads, seq, d]");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "q, k, v dtypes differ");
  TORCH_CHECK(positions.scalar_type() == at::kLong && bounds.scalar_type() == at::kLong, "int64 plan");
  const int64_t hq = q.size(1), b = q.size(2), d = q.size(3), hkv = k.size(1), n_keys = k.size(2);
  TORCH_CHECK(hkv > 0 && hq % hkv == 0 && k.size(3) == d && v.sizes() == k.sizes(), "head counts or dims differ");
  TORCH_CHECK(positions.numel() == b && positions.is_contiguous() && bounds.is_contiguous(), "plan does not fit q");
  const int64_t num_tiles = bounds.numel() - 1;
  TORCH_CHECK(b == 0 || (num_tiles >= 1 && bounds.data_ptr<int64_t>()[num_tiles] <= n_keys), "plan exceeds keys");
  at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  at::Tensor kc = k.stride(3) == 1 ? k : k.contiguous();
  at::Tensor vc = v.stride(3) == 1 ? v : v.contiguous();
  // [1, B, Hq, d]: the layout attention modules return (transposing it back is free for the caller).
  at::Tensor out = at::empty({1, b, hq, d}, q.options());
  if (b == 0) return out.transpose(1, 2);
  const int64_t group = hq / hkv;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* bnd = bounds.data_ptr<int64_t>();
  // Row chunks: at most max_chunk_rows folded rows each (their state stays in cache), and, when there are several
  // threads, a count that gives every thread the same number of (KV head, chunk) items where the rows allow it.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t min_chunks =
      std::max<int64_t>(1, (b * group + max_chunk_rows - 1) / std::max<int64_t>(1, max_chunk_rows));
  int64_t chunks = min_chunks;
  while (chunks < b && chunks < min_chunks * threads && (hkv * chunks) % threads != 0) ++chunks;
  chunks = std::min<int64_t>(chunks, b);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "onepass_attention", [&] {
    using acc_t = std::conditional_t<std::is_same<scalar_t, double>::value, double, float>;
    const scalar_t* qp = qc.data_ptr<scalar_t>();
    const scalar_t* kp = kc.data_ptr<scalar_t>();
    const scalar_t* vp = vc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, hkv * chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t h = item / chunks, c = item % chunks;
        const int64_t r0 = b * c / chunks, r1 = b * (c + 1) / chunks;
        if (r0 == r1) continue;
        attend_chunk<scalar_t, acc_t>(qp, qc.stride(1), qc.stride(2), kp + h * kc.stride(1), kc.stride(2),
                                      vp + h * vc.stride(1), vc.stride(2), op, out.stride(1), out.stride(2), pos,
                                      bnd, num_tiles, h, group, r0, r1, d, static_cast<acc_t>(scale));
      }
    });
  });
  return out.transpose(1, 2);
}

}  // namespace

TORCH_LIBRARY(sur_lab_onepass, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor bounds, float scale, int max_chunk_rows) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(sur_lab_onepass, CPU, m) { m.impl("attention", &onepass_attention); }

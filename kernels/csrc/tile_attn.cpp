// ditkit CPU tile attention: the per-query-tile "rest" of block-sparse attention in one fused native pass.
//
// For each 64-row query tile i: gather the live rows of its selected 64-row key/value tiles into two
// thread-local buffers, S = scale * Q_i K^T (one sgemm), exact row softmax (max, exp, sum; vectorised),
// O_i = P V / sum (one sgemm), lse = max + log(sum). No -inf masking is needed: pad key rows are never
// gathered. Parallel over query tiles (at::parallel_for). All element offsets are int64.
//
// Contract (checked in Python, re-checked here): q [n, 64, D] fp32 contiguous; k, v [Tk, 64, D] fp32
// contiguous (tile-major); sel [n, cmax] int64 ascending tile ids (only the first cnt[i] are used);
// cnt [n] int64; live [Tk] int64 (live key rows per tile, 1..64). Returns (out [n, 64, D], lse [n, 64]),
// lse in natural log; a tile with no live key rows gets out 0 and lse -inf.
#if defined(__AVX512F__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

// Fortran BLAS sgemm, exported by libtorch_cpu (MKL on x86_64 wheels).
extern "C" void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
                       const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);

namespace {

constexpr int64_t kTile = 64;

inline void gemm(char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                 const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const int mi = (int)m, ni = (int)n, ki = (int)k, la = (int)lda, lb = (int)ldb, lc = (int)ldc;
  sgemm_(&ta, &tb, &mi, &ni, &ki, &alpha, a, &la, b, &lb, &beta, c, &lc);
}

}  // namespace

std::vector<at::Tensor> tile_attn_fwd(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor sel, at::Tensor cnt,
                                      at::Tensor live, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && sel.dim() == 2, "bad ranks");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "tile_attn_fwd: fp32 only");
  TORCH_CHECK(sel.scalar_type() == at::kLong && cnt.scalar_type() == at::kLong && live.scalar_type() == at::kLong,
              "tile_attn_fwd: int64 indices");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && sel.is_contiguous() &&
              cnt.is_contiguous() && live.is_contiguous(), "tile_attn_fwd: contiguous inputs");
  const int64_t n = q.size(0), M = q.size(1), D = q.size(2), Tk = k.size(0), cmax = sel.size(1);
  TORCH_CHECK(M == kTile && k.size(1) == kTile && v.sizes() == k.sizes() && k.size(2) == D, "bad shapes");
  TORCH_CHECK(cnt.numel() == n && live.numel() == Tk && sel.size(0) == n, "bad index shapes");
  auto out = at::empty_like(q);
  auto lse = at::empty({n, M}, q.options());
  if (n == 0) return {out, lse};
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* sp = sel.data_ptr<int64_t>();
  const int64_t* cp = cnt.data_ptr<int64_t>();
  const int64_t* lp = live.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(cp[i] >= 0 && cp[i] <= cmax, "cnt out of range");
    for (int64_t j = 0; j < cp[i]; ++j) TORCH_CHECK(sp[i * cmax + j] >= 0 && sp[i * cmax + j] < Tk, "tile id out of range");
  }
  for (int64_t t = 0; t < Tk; ++t) TORCH_CHECK(lp[t] >= 0 && lp[t] <= kTile, "live rows per tile must be 0..64");
  float* op = out.data_ptr<float>();
  float* ep = lse.data_ptr<float>();
  const float sc = (float)scale;
  using Vec = at::vec::Vectorized<float>;
  at::parallel_for(0, n, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> S(M * cmax * kTile), Kb(cmax * kTile * D), Vb(cmax * kTile * D);
    float sums[kTile], maxs[kTile];
    for (int64_t i = b0; i < b1; ++i) {
      const int64_t c = cp[i];
      const float* qi = qp + i * M * D;
      float* oi = op + i * M * D;
      int64_t L = 0;
      for (int64_t j = 0; j < c; ++j) {
        const int64_t t = sp[i * cmax + j];
        const int64_t lv = lp[t];
        std::memcpy(Kb.data() + L * D, kp + t * kTile * D, sizeof(float) * lv * D);
        std::memcpy(Vb.data() + L * D, vp + t * kTile * D, sizeof(float) * lv * D);
        L += lv;
      }
      if (L == 0) {  // nothing selected (or only empty tiles): softmax over no keys
        std::memset(oi, 0, sizeof(float) * M * D);
        for (int64_t s = 0; s < M; ++s) ep[i * M + s] = -std::numeric_limits<float>::infinity();
        continue;
      }
      // column-major view: S^T (L x M) = K_buf (L x D) * Q_i^T (D x M)  ==  row-major S [M, L] = Q_i K_buf^T
      gemm('T', 'N', L, M, D, sc, Kb.data(), D, qi, D, 0.f, S.data(), L);
      for (int64_t s = 0; s < M; ++s) {
        float* row = S.data() + s * L;
        const float mx = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, row, L);
        const Vec vmx(mx);
        Vec vsum(0.f);
        int64_t r = 0;
        for (; r + Vec::size() <= L; r += Vec::size()) {
          Vec x = (Vec::loadu(row + r) - vmx).exp_u20();
          x.store(row + r);
          vsum = vsum + x;
        }
        float sm = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum);
        for (; r < L; ++r) {
          row[r] = std::exp(row[r] - mx);
          sm += row[r];
        }
        sums[s] = sm;
        maxs[s] = mx;
      }
      // column-major: O_i^T (D x M) = V_buf^T (D x L) * P^T (L x M)  ==  row-major O_i [M, D] = P V_buf
      gemm('N', 'N', D, M, L, 1.f, Vb.data(), D, S.data(), L, 0.f, oi, D);
      for (int64_t s = 0; s < M; ++s) {
        const float inv = 1.f / sums[s];
        at::vec::map([inv](Vec x) { return x * Vec(inv); }, oi + s * D, oi + s * D, D);
        ep[i * M + s] = maxs[s] + std::log(sums[s]);
      }
    }
  });
  return {out, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tile_attn_fwd", &tile_attn_fwd, "per-query-tile gathered attention (fp32, CPU)");
}

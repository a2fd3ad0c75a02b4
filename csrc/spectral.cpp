// Batched spectral reductions for gradspec.
//
// Every matrix handed in is a small symmetric PSD Gram (fp64). Eigenvalues come from
// LAPACK's dsyevd, factors from dpotrf or dpstrf and products from BLAS's dgemm/dsyrk/dtrmm, all bound at
// import time as function pointers (SciPy's cython_lapack / cython_blas, or the MKL that
// torch exports), so the build needs no LAPACK headers or libraries and no torch. Work is
// spread over the batch on OpenMP threads (torch's own, see parallel_for) with the GIL released.
#include <omp.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <atomic>
#include <exception>
#include <cmath>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using dsyevd_t = void(char*, char*, int*, double*, int*, double*, double*, int*, int*, int*, int*);
using dpstrf_t = void(char*, int*, double*, int*, int*, int*, double*, double*, int*);
using dpotrf_t = void(char*, int*, double*, int*, int*);
using dtrmm_t = void(char*, char*, char*, char*, int*, int*, double*, double*, int*, double*, int*);
using dsyrk_t = void(char*, char*, int*, int*, double*, double*, int*, double*, double*, int*);
using dgemm_t = void(char*, char*, int*, int*, int*, double*, double*, int*, double*, int*, double*,
                     double*, int*);

dsyevd_t* dsyevd_ = nullptr;
dgemm_t* dgemm_ = nullptr;
dpstrf_t* dpstrf_ = nullptr;
dpotrf_t* dpotrf_ = nullptr;
dtrmm_t* dtrmm_ = nullptr;
dsyrk_t* dsyrk_ = nullptr;

// A LAPACK routine that reports failure (info != 0): raised in Python as gradspec._C.LapackError,
// which the caller retries on another path and otherwise flags, instead of ending the run.
struct LapackError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

using set_local_threads_t = int(int);
set_local_threads_t* mkl_set_num_threads_local_ = nullptr;

// Addresses of the BLAS/LAPACK routines, resolved in Python (SciPy's capsules, or the MKL that
// torch's CPU build exports). mkl_set_num_threads_local is that MKL's per-thread thread count
// (0 when MKL is not used).
void bind_lapack(uintptr_t dsyevd, uintptr_t dpstrf, uintptr_t dpotrf, uintptr_t dgemm, uintptr_t dsyrk,
                 uintptr_t dtrmm, uintptr_t mkl_set_num_threads_local) {
  dsyevd_ = reinterpret_cast<dsyevd_t*>(dsyevd);
  dpstrf_ = reinterpret_cast<dpstrf_t*>(dpstrf);
  dpotrf_ = reinterpret_cast<dpotrf_t*>(dpotrf);
  dgemm_ = reinterpret_cast<dgemm_t*>(dgemm);
  dsyrk_ = reinterpret_cast<dsyrk_t*>(dsyrk);
  dtrmm_ = reinterpret_cast<dtrmm_t*>(dtrmm);
  mkl_set_num_threads_local_ = reinterpret_cast<set_local_threads_t*>(mkl_set_num_threads_local);
}

void require_bound() {
  if (dsyevd_ == nullptr || dpstrf_ == nullptr || dpotrf_ == nullptr || dgemm_ == nullptr || dsyrk_ == nullptr ||
      dtrmm_ == nullptr)
    throw std::runtime_error("gradspec._C: LAPACK not bound; call bind_lapack first");
}

// Eigen-solver with reusable workspace, and the scratch of a thread's other work: one per thread,
// kept across the samples it solves (no allocation per sample). The workspace query is cached per
// (n, vectors): at n = 64 it costs as much as the solve.
struct SymmetricEigen {
  std::vector<double> work, scratch, values;
  std::vector<int> iwork;
  std::vector<double> l, chol, f, w, core, ev, y, x, g;  // core_sample's, segment_gram's, product_gram's scratch
  std::vector<int> piv;
  int lwork = 0, liwork = 0, cached_n = -1;
  bool cached_vectors = false;

  // Eigenvalues (ascending) of the n x n symmetric matrix a, overwritten by the
  // eigenvectors (column-major) when vectors is true.
  void operator()(double* a, int n, double* w, bool vectors) {
    if (n == 0) return;
    char jobz = vectors ? 'V' : 'N', uplo = 'U';
    int info = 0;
    if (n != cached_n || vectors != cached_vectors) {
      int query = -1, iw = 0;
      double wq = 0;
      dsyevd_(&jobz, &uplo, &n, a, &n, w, &wq, &query, &iw, &query, &info);
      lwork = static_cast<int>(wq) + 1;
      liwork = std::max(iw, 1);
      if (static_cast<int>(work.size()) < lwork) work.resize(lwork);
      if (static_cast<int>(iwork.size()) < liwork) iwork.resize(liwork);
      cached_n = n;
      cached_vectors = vectors;
    }
    dsyevd_(&jobz, &uplo, &n, a, &n, w, work.data(), &lwork, iwork.data(), &liwork, &info);
    if (info != 0) throw LapackError("dsyevd failed with info=" + std::to_string(info));
  }
};

// v with room for at least n elements (grown, never shrunk: a thread's scratch is reused).
template <typename V>
V& sized(V& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v;
}

// The rounding floor of an n x n Gram formed from sums of `terms` products at precision eps:
// max(n, terms) * eps * top (the rule of gradspec.metrics.eigenvalue_cutoff).
double cutoff_of(int n, int terms, double eps, double top) { return std::max(n, terms) * eps * std::max(top, 0.0); }

// sigma (descending, length n, zero-padded) from the ascending eigenvalues lam of a Gram of G.
// Eigenvalues below the cut-off are the Gram's rounding and count as zero. The metrics of sigma
// are computed in one place, gradspec.linalg.metrics, for every path.
void singular_values_from_eigenvalues(const double* lam, int n, double eps, int terms, double* sigma) {
  const double cutoff = n > 0 ? cutoff_of(n, terms, eps, lam[n - 1]) : 0.0;
  for (int k = 0; k < n; ++k) {
    double l = lam[n - 1 - k];
    sigma[k] = l > cutoff ? std::sqrt(l) : 0.0;
  }
}

// A thread's solver and scratch, kept across calls (the threads are OpenMP's and persist).
SymmetricEigen& thread_scratch() {
  thread_local SymmetricEigen scratch;
  return scratch;
}

// Runs task(i, scratch) for i in [0, n) on up to `threads` OpenMP threads. Imported after torch,
// the extension shares torch's OpenMP runtime (same soname, libgomp.so.1), so these are the very
// threads torch's own ops run on: none spins beside them, and none is created per call. Callers
// hold SciPy's OpenBLAS at one thread meanwhile (gradspec.linalg.extension.ONE_BLAS_THREAD): its
// own threads inside an OpenMP region would oversubscribe the cores (and OpenBLAS warns of hangs).
void parallel_for(int n, int threads, const std::function<void(int, SymmetricEigen&)>& task) {
  threads = std::max(1, std::min(threads, n));
  std::atomic<int> next{0};
  std::vector<std::exception_ptr> errors(threads);
  {
    py::gil_scoped_release release;
#pragma omp parallel num_threads(threads)
    {
      // The region supplies the parallelism: MKL runs one thread inside it, whatever the region's
      // size and whatever mkl_set_num_threads or torch.set_num_threads last set. Its thread count
      // changes its rounding, so a sample's spectra would otherwise depend on the batch beside it
      // (a region of one thread is not nested) and on the caller's settings. MKL's per-thread
      // setting outranks the global one; the thread's previous one is put back after.
      const int previous = mkl_set_num_threads_local_ ? mkl_set_num_threads_local_(1) : 0;
      const int t = omp_get_thread_num();
      try {
        for (int i = next++; i < n; i = next++) task(i, thread_scratch());
      } catch (...) {
        errors[t] = std::current_exception();  // rethrown with its type (LapackError stays one)
        next = n;
      }
      if (mkl_set_num_threads_local_) mkl_set_num_threads_local_(previous);
    }
  }
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

using Array = py::array_t<double, py::array::c_style | py::array::forcecast>;
using Lengths = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

const int64_t* checked_lengths(const Lengths& lengths, int N, int T) {
  if (lengths.ndim() != 1 || lengths.shape(0) != N) throw std::invalid_argument("lengths must have shape (N,)");
  const int64_t* len = lengths.data();
  for (int i = 0; i < N; ++i)
    if (len[i] < 0 || len[i] > T) throw std::invalid_argument("lengths must lie in [0, T]");
  return len;
}

// The batch samples a call forms, (K,) indices into lengths (N,): rows, or every sample where rows is None.
// Only the picked samples' lengths must lie in [0, T]: a caller passes Y sliced to the picked ones' longest.
std::vector<int> picked_samples(const Lengths& lengths, py::object rows, int N, int T) {
  if (lengths.ndim() != 1 || lengths.shape(0) != N) throw std::invalid_argument("lengths must have shape (N,)");
  std::vector<int> picked;
  if (rows.is_none()) {
    for (int i = 0; i < N; ++i) picked.push_back(i);
  } else {
    Lengths r = rows.cast<Lengths>();
    if (r.ndim() != 1) throw std::invalid_argument("rows must have shape (K,)");
    for (py::ssize_t k = 0; k < r.shape(0); ++k) {
      if (r.data()[k] < 0 || r.data()[k] >= N) throw std::invalid_argument("rows must lie in [0, N)");
      picked.push_back(static_cast<int>(r.data()[k]));
    }
  }
  for (int i : picked)
    if (lengths.data()[i] < 0 || lengths.data()[i] > T) throw std::invalid_argument("lengths must lie in [0, T]");
  return picked;
}

// Output entries by decreasing length of their samples: tasks handed out longest first (dynamic scheduling
// then ends with the short ones, so no thread waits long on another's last task).
std::vector<int> longest_first(const std::vector<int>& picked, const int64_t* len) {
  std::vector<int> order(picked.size());
  for (size_t k = 0; k < picked.size(); ++k) order[k] = static_cast<int>(k);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return len[picked[a]] > len[picked[b]]; });
  return order;
}

// A sample of SPLIT_ROWS rows or more is two tasks of about equal time (where splittable), finished by whichever
// ends second: decided by its length alone, so that its rounding does not depend on the samples beside it.
constexpr int SPLIT_ROWS = 64;

// (output entry, part) per task, longest samples first: part -1 the whole sample, else 0 and 1 (its two halves).
std::vector<std::pair<int, int>> split_tasks(const std::vector<int>& picked, const int64_t* len, bool splittable) {
  std::vector<std::pair<int, int>> tasks;
  for (int k : longest_first(picked, len)) {
    if (splittable && len[picked[k]] >= SPLIT_ROWS) {
      tasks.emplace_back(k, 0);
      tasks.emplace_back(k, 1);
    } else {
      tasks.emplace_back(k, -1);
    }
  }
  return tasks;
}

// One Gram's singular values (sigma, length n) from its n x n matrix a.
void gram_sample(const double* a, int n, double eps, int terms, double* sigma, SymmetricEigen& eig) {
  eig.scratch.assign(a, a + static_cast<size_t>(n) * n);
  eig.values.resize(n);
  eig(eig.scratch.data(), n, eig.values.data(), false);
  singular_values_from_eigenvalues(eig.values.data(), n, eps, terms, sigma);
}

// Singular values of G from Grams G G^T (or G^T G): grams is (N, n, n).
Array gram_spectra(Array grams, int threads, double eps, int terms) {
  require_bound();
  if (grams.ndim() != 3 || grams.shape(1) != grams.shape(2))
    throw std::invalid_argument("grams must have shape (N, n, n)");
  const int N = static_cast<int>(grams.shape(0)), n = static_cast<int>(grams.shape(1));
  Array sigma({N, n});
  const double* in = grams.data();
  double* s_out = sigma.mutable_data();
  parallel_for(N, threads, [&](int i, SymmetricEigen& eig) {
    gram_sample(in + static_cast<size_t>(i) * n * n, n, eps, terms, s_out + static_cast<size_t>(i) * n, eig);
  });
  return sigma;
}

// gram_spectra over several groups at once (a batch's materialised parts: each (N_g, n_g, n_g), with
// its terms): one job of every (group, sample), so a part of one or a few samples does not leave
// threads idle. Returns each group's sigma (N_g, n_g).
py::list gram_spectra_groups(py::list grams, py::list terms, int threads, double eps) {
  require_bound();
  if (terms.size() != grams.size()) throw std::invalid_argument("grams and terms must have one entry per group");
  std::vector<Array> in;
  std::vector<Array> out;
  std::vector<int> group_terms;
  std::vector<std::pair<int, int>> tasks;  // (group, sample)
  for (size_t g = 0; g < grams.size(); ++g) {
    Array a = grams[g].cast<Array>();
    if (a.ndim() != 3 || a.shape(1) != a.shape(2)) throw std::invalid_argument("grams must have shape (N, n, n)");
    for (int i = 0; i < a.shape(0); ++i) tasks.emplace_back(static_cast<int>(g), i);
    out.push_back(Array({a.shape(0), a.shape(1)}));
    in.push_back(a);
    group_terms.push_back(terms[g].cast<int>());
  }
  std::stable_sort(tasks.begin(), tasks.end(), [&](const auto& x, const auto& y) {  // largest first
    return in[x.first].shape(1) > in[y.first].shape(1);
  });
  parallel_for(static_cast<int>(tasks.size()), threads, [&](int k, SymmetricEigen& eig) {
    const auto [g, i] = tasks[k];
    const int n = static_cast<int>(in[g].shape(1));
    gram_sample(in[g].data() + static_cast<size_t>(i) * n * n, n, eps, group_terms[g],
                const_cast<double*>(out[g].data()) + static_cast<size_t>(i) * n, eig);
  });
  py::list result;
  for (auto& sigma : out) result.append(sigma);
  return result;
}

// Spectra of G_ij = D_ij^T X_i from B_i = X_i X_i^T (N, T, T) and A_ij = D_ij D_ij^T
// (N, M, T, T): for any factor F with B = F F^T, the singular values of G are the square
// roots of the eigenvalues of the core F^T A F. F comes from a Cholesky (core_sample: unpivoted,
// or pivoted and rank-revealing), ~25x cheaper than an eigendecomposition;
// one factorisation serves all M modules that share the input X. Sample i uses the
// leading lengths[i] x lengths[i] blocks (the rest is padding), so padding costs nothing.
// One sample's spectra of its M parts: b (ldb x ldb, the leading n x n block read), a[j] likewise,
// sigma[j] (length T, zero-padded) written.
void core_sample(const double* b, const std::vector<const double*>& a, int ld, int n, int T, double eps,
                 int terms, double* sigma, size_t sigma_stride, SymmetricEigen& eig) {
  const int M = static_cast<int>(a.size());
  std::vector<double>& l = sized(eig.l, static_cast<size_t>(n) * n);
  std::vector<double>& chol_work = sized(eig.chol, 2 * std::max(n, 1));
  std::vector<int>& piv = sized(eig.piv, std::max(n, 1));
  auto copy_b = [&] {  // B's leading n x n block into l
    for (int c = 0; c < n; ++c)
      std::copy(b + static_cast<size_t>(c) * ld, b + static_cast<size_t>(c) * ld + n, l.begin() + static_cast<size_t>(c) * n);
  };
  copy_b();
  // B's factor: the unpivoted Cholesky (dpotrf) where B is positive definite at fp64, as on the
  // device paths; else the pivoted one (dpstrf), rank-revealing, which drops the pivots below the
  // cut-off (B's rounding: repeated inputs). Cholesky is backward stable, so either factor gives
  // the core's eigenvalues to B's rounding; what lies below the core's cut-off is zeroed either way
  // (measured on SmolLM2: metrics within 2e-9 relative of the pivoted factor's, the core job 7% faster).
  int r = 0;
  bool pivoted = false;  // else F = L
  if (n > 0) {
    char lower = 'L';
    int n_ = n, info = 0;
    double max_diag = 0;
    for (int c = 0; c < n; ++c) max_diag = std::max(max_diag, l[static_cast<size_t>(c) * n + c]);
    double tol = cutoff_of(n, terms, eps, max_diag);  // pivots below it are B's rounding
    dpotrf_(&lower, &n_, l.data(), &n_, &info);
    if (info == 0) {
      r = n;
    } else {
      if (info < 0) throw LapackError("dpotrf failed with info=" + std::to_string(info));
      pivoted = true;
      copy_b();
      info = 0;
      dpstrf_(&lower, &n_, l.data(), &n_, piv.data(), &r, &tol, chol_work.data(), &info);
      if (info < 0) throw LapackError("dpstrf failed with info=" + std::to_string(info));
    }
  }
  const int r1 = std::max(r, 1);
  // Pivoted: F = P L, row piv[t]-1 of F is row t of the lower-triangular L (first r columns).
  std::vector<double>& f = sized(eig.f, static_cast<size_t>(n) * r1);
  std::vector<double>& w = sized(eig.w, static_cast<size_t>(n) * r1);
  std::vector<double>& core = sized(eig.core, static_cast<size_t>(r1) * r1);
  std::vector<double>& ev = sized(eig.ev, r1);
  if (pivoted) {
    std::fill(f.begin(), f.begin() + static_cast<size_t>(n) * r1, 0.0);
    for (int k = 0; k < r; ++k)
      for (int t = k; t < n; ++t) f[static_cast<size_t>(k) * n + piv[t] - 1] = l[static_cast<size_t>(k) * n + t];
  }
  for (int j = 0; j < M; ++j) {
    double* out = sigma + j * sigma_stride;
    std::fill(out, out + T, 0.0);
    if (r > 0) {
      char nn = 'N', tr = 'T', left = 'L', right = 'R', lower = 'L';
      double one = 1.0, zero = 0.0;
      int n_ = n, r_ = r, ld_ = ld;
      // A is symmetric, so its row-major layout is also its column-major one; its
      // leading n x n block is read with leading dimension ld.
      if (pivoted) {
        dgemm_(&nn, &nn, &n_, &r_, &n_, &one, const_cast<double*>(a[j]), &ld_, f.data(), &n_, &zero, w.data(), &n_);
        dgemm_(&tr, &nn, &r_, &r_, &n_, &one, f.data(), &n_, w.data(), &n_, &zero, core.data(), &r_);
      } else {  // L^T A L by two triangular products in place: half the work of two GEMMs
        for (int c = 0; c < n; ++c)
          std::copy(a[j] + static_cast<size_t>(c) * ld, a[j] + static_cast<size_t>(c) * ld + n,
                    core.begin() + static_cast<size_t>(c) * n);
        dtrmm_(&right, &lower, &nn, &nn, &n_, &n_, &one, l.data(), &n_, core.data(), &n_);
        dtrmm_(&left, &lower, &tr, &nn, &n_, &n_, &one, l.data(), &n_, core.data(), &n_);
      }
      eig(core.data(), r, ev.data(), false);
    }
    singular_values_from_eigenvalues(ev.data(), r, eps, terms, out);
  }
}

Array core_spectra(Array B, Array A, Lengths lengths, int threads, double eps, int terms) {
  require_bound();
  if (B.ndim() != 3 || B.shape(1) != B.shape(2)) throw std::invalid_argument("B must have shape (N, T, T)");
  if (A.ndim() != 4 || A.shape(0) != B.shape(0) || A.shape(2) != B.shape(1) || A.shape(3) != B.shape(1))
    throw std::invalid_argument("A must have shape (N, M, T, T) matching B");
  const int N = static_cast<int>(B.shape(0)), M = static_cast<int>(A.shape(1)), T = static_cast<int>(B.shape(1));
  const int64_t* len = checked_lengths(lengths, N, T);
  Array sigma({N, M, T});
  const double* b_in = B.data();
  const double* a_in = A.data();
  double* s_out = sigma.mutable_data();
  const size_t TT = static_cast<size_t>(T) * T;
  parallel_for(N, threads, [&](int i, SymmetricEigen& eig) {
    std::vector<const double*> a(M);
    for (int j = 0; j < M; ++j) a[j] = a_in + (static_cast<size_t>(i) * M + j) * TT;
    core_sample(b_in + i * TT, a, T, static_cast<int>(len[i]), T, eps, terms, s_out + static_cast<size_t>(i) * M * T,
                T, eig);
  });
  return sigma;
}

// core_spectra over several groups at once (a batch's inputs: each its B (N_g, T_g, T_g), its parts'
// A's (each (N_g, T_g, T_g)), lengths and terms): one job of every (group, sample), so the threads
// stay busy when each group has fewer samples than threads (a batch of one long sample), and no
// stacked copy of the A's is made. Tasks are handed out largest first, so the job ends on small ones.
// Returns each group's sigma (N_g, M_g, T_g).
py::list core_spectra_groups(py::list Bs, py::list As, py::list lengths, py::list terms, int threads, double eps) {
  require_bound();
  const size_t G = Bs.size();
  if (As.size() != G || lengths.size() != G || terms.size() != G)
    throw std::invalid_argument("Bs, As, lengths and terms must have one entry per group");
  struct Group {
    Array B;
    std::vector<Array> A;
    Lengths len;
    int terms, N, T;
    Array sigma;
  };
  std::vector<Group> groups;
  std::vector<std::pair<int, int>> tasks;  // (group, sample)
  for (size_t g = 0; g < G; ++g) {
    Group grp{Bs[g].cast<Array>(), {}, lengths[g].cast<Lengths>(), terms[g].cast<int>(), 0, 0, Array()};
    if (grp.B.ndim() != 3 || grp.B.shape(1) != grp.B.shape(2)) throw std::invalid_argument("B must have shape (N, T, T)");
    grp.N = static_cast<int>(grp.B.shape(0));
    grp.T = static_cast<int>(grp.B.shape(1));
    for (auto a : As[g].cast<py::list>()) {
      Array arr = a.cast<Array>();
      if (arr.ndim() != 3 || arr.shape(0) != grp.N || arr.shape(1) != grp.T || arr.shape(2) != grp.T)
        throw std::invalid_argument("each A must have B's shape (N, T, T)");
      grp.A.push_back(arr);
    }
    checked_lengths(grp.len, grp.N, grp.T);
    grp.sigma = Array({grp.N, static_cast<int>(grp.A.size()), grp.T});
    for (int i = 0; i < grp.N; ++i) tasks.emplace_back(static_cast<int>(g), i);
    groups.push_back(std::move(grp));
  }
  auto cost = [&](const std::pair<int, int>& t) {  // n^3 per factor and per part
    const Group& grp = groups[t.first];
    const double n = static_cast<double>(grp.len.data()[t.second]);
    return n * n * n * (grp.A.size() + 1);
  };
  std::stable_sort(tasks.begin(), tasks.end(), [&](const auto& x, const auto& y) { return cost(x) > cost(y); });
  parallel_for(static_cast<int>(tasks.size()), threads, [&](int k, SymmetricEigen& eig) {
    const auto [g, i] = tasks[k];
    const Group& grp = groups[g];
    const size_t TT = static_cast<size_t>(grp.T) * grp.T;
    std::vector<const double*> a(grp.A.size());
    for (size_t j = 0; j < a.size(); ++j) a[j] = grp.A[j].data() + i * TT;
    double* out = const_cast<double*>(grp.sigma.data()) + static_cast<size_t>(i) * a.size() * grp.T;
    core_sample(grp.B.data() + i * TT, a, grp.T, static_cast<int>(grp.len.data()[i]), grp.T, eps, grp.terms, out,
                grp.T, eig);
  });
  py::list out;
  for (auto& grp : groups) out.append(grp.sigma);
  return out;
}

// Y_i's valid rows [0, n) as fp64 into y (row-major n x d == column-major d x n). Y may be
// strided (a view of a fused projection's output).
template <typename Scalar>
void rows_as_double(const char* sample, const py::ssize_t* strides, int n, int d, std::vector<double>& y) {
  sized(y, static_cast<size_t>(n) * d);
  for (int t = 0; t < n; ++t) {
    const char* row = sample + t * strides[1];
    double* dst = y.data() + static_cast<size_t>(t) * d;
    if (strides[2] == static_cast<py::ssize_t>(sizeof(Scalar))) {  // contiguous features: a vectorisable copy
      const Scalar* src = reinterpret_cast<const Scalar*>(row);
      for (int k = 0; k < d; ++k) dst[k] = src[k];
    } else {
      for (int k = 0; k < d; ++k) dst[k] = *reinterpret_cast<const Scalar*>(row + k * strides[2]);
    }
  }
}

// A Gram whose lower triangle (column-major, leading dimension T) holds the leading n x n block:
// its upper triangle mirrored by 32 x 32 tiles (the strided writes stay in L1), the padding zeroed,
// and <Gram, other> over the n x n block when other is given (contiguous, both triangles counted).
double finish_gram(double* g, int n, int T, const double* other) {
  constexpr int B = 32;
  for (int cb = 0; cb < n; cb += B)
    for (int rb = cb; rb < n; rb += B)
      for (int c = cb; c < std::min(cb + B, n); ++c)
        for (int r = std::max(rb, c + 1); r < std::min(rb + B, n); ++r)
          g[static_cast<size_t>(r) * T + c] = g[static_cast<size_t>(c) * T + r];
  for (int c = 0; c < T; ++c) std::fill(g + static_cast<size_t>(c) * T + (c < n ? n : 0), g + static_cast<size_t>(c + 1) * T, 0.0);
  double inner = 0;
  if (other)
    for (int c = 0; c < n; ++c) {
      const double* gc = g + static_cast<size_t>(c) * T;
      const double* oc = other + static_cast<size_t>(c) * T;
#pragma omp simd reduction(+ : inner)
      for (int r = 0; r < n; ++r) inner += gc[r] * oc[r];
    }
  return inner;
}

// fp64 Gram of each picked sample's valid rows, Y_i[:n] Y_i[:n]^T, with BLAS dsyrk (half the work of a
// GEMM, none spent on padding), and <Gram_k, other_k> where other (K, T, T) is given; rows (K,) picks the
// batch samples (None: all), so the caller gathers nothing. One task per
// sample does all of its work while its Gram is in cache: rows to fp64, dsyrk, mirror, padding,
// inner product. A sample of SPLIT_ROWS rows or more is two tasks of about equal time (below), finished
// by whichever ends second: decided by its length alone, so that its Gram's rounding does not depend on the
// samples beside it (an expert's segment scores the same stacked with others' or alone).
template <typename Scalar>
py::tuple segment_gram(py::array_t<Scalar> Y, Lengths lengths, py::object other, int threads, py::object rows) {
  require_bound();
  if (Y.ndim() != 3) throw std::invalid_argument("Y must have shape (N, T, d)");
  const int N = static_cast<int>(Y.shape(0)), T = static_cast<int>(Y.shape(1)), d = static_cast<int>(Y.shape(2));
  const std::vector<int> picked = picked_samples(lengths, rows, N, T);
  const int K = static_cast<int>(picked.size());
  const int64_t* len = lengths.data();
  Array others;
  if (!other.is_none()) {
    others = other.cast<Array>();
    if (others.ndim() != 3 || others.shape(0) != K || others.shape(1) != T || others.shape(2) != T)
      throw std::invalid_argument("other must have shape (K, T, T) like the Gram");
  }
  const auto ys = Y.strides();
  const char* base = reinterpret_cast<const char*>(Y.data());
  py::array_t<double> out({K, T, T});  // every entry written by its sample's task
  double* o = out.mutable_data();
  py::array_t<double> inners(K);
  double* in_out = inners.mutable_data();
  const double* oth = other.is_none() ? nullptr : others.data();
  const auto tasks = split_tasks(picked, len, true);
  std::vector<std::atomic<int>> done(K);
  for (auto& count : done) count = 0;
  parallel_for(static_cast<int>(tasks.size()), threads, [&](int task, SymmetricEigen& scratch) {
    const int k = tasks[task].first, part = tasks[task].second, i = picked[k];
    const int split = part < 0 ? 1 : 2;
    const int n = static_cast<int>(len[i]);
    const size_t TT = static_cast<size_t>(T) * T;
    double* g = o + k * TT;  // column-major, leading dimension T
    if (n > 0) {
      std::vector<double>& y = scratch.y;
      // Split: part 0 the rows [0, h) by dsyrk; part 1 the rows [h, n) by dsyrk and the block below part 0's by
      // dgemm (MKL's, faster than OpenBLAS's dsyrk). h = 0.68 n gives part 0 46% of the FLOPs: the fastest split
      // measured of 0.5-0.72 n at n = 84-372 (2-core Xeon; 0.75 ms against 1.05 at n = 372 for h = n / 2).
      const int h = part < 0 ? n : static_cast<int>(0.68 * n);
      rows_as_double<Scalar>(base + i * ys[0], ys, part == 0 ? h : n, d, y);
      char lower = 'L', trans = 'T', nn = 'N';
      int d_ = d, ld = T;
      double one = 1.0, zero = 0.0;
      auto syrk = [&](int first, int rows) {
        if (rows == 0) return;
        double* block = g + static_cast<size_t>(first) * T + first;
        dsyrk_(&lower, &trans, &rows, &d_, &one, y.data() + static_cast<size_t>(first) * d, &d_, &zero, block, &ld);
      };
      if (part <= 0) syrk(0, h);
      if (part == 1) {
        syrk(h, n - h);
        if (h > 0 && n - h > 0) {  // G[h:n, 0:h] = Y[h:n] Y[0:h]^T
          int below = n - h, left = h;
          dgemm_(&trans, &nn, &below, &left, &d_, &one, y.data() + static_cast<size_t>(h) * d, &d_, y.data(), &d_, &zero,
                 g + h, &ld);
        }
      }
    }
    if (split == 1 || ++done[k] == split) in_out[k] = finish_gram(g, n, T, oth ? oth + k * TT : nullptr);
  });
  return py::make_tuple(out, oth ? py::object(inners) : py::none());
}

// fp64 Gram of each sample's G_i = D_i[:n]^T X_i[:n] (p x q): G G^T (p x p) where p <= q, else G^T G
// (q x q), (K, m, m) with m = min(p, q), for the samples whose length reaches the smaller side (the
// materialised path; shorter ones take the T x T core). With V the narrower of D and X and W the other, the
// Gram is H H^T for H = V^T W (m x w). Only the valid rows are read (no padding), both go to fp64 once per
// sample, H by dgemm, its Gram by dsyrk (half a GEMM). rows (K,) picks the batch samples (None: all), so the
// caller gathers nothing. A sample of SPLIT_ROWS rows or more and m >= 2 is two tasks: H's first h rows and
// their Gram block, the other rows and theirs; whichever ends second forms the block between them. That is
// decided by the sample's shape alone, so its rounding does not depend on the samples beside it.
template <typename Scalar>
py::array_t<double> product_gram(py::array_t<Scalar> D, py::array_t<Scalar> X, Lengths lengths, py::object rows,
                                 int threads) {
  require_bound();
  if (D.ndim() != 3 || X.ndim() != 3 || D.shape(0) != X.shape(0) || D.shape(1) != X.shape(1))
    throw std::invalid_argument("D and X must have shapes (N, T, p) and (N, T, q)");
  const int N = static_cast<int>(D.shape(0)), T = static_cast<int>(D.shape(1));
  const bool d_narrow = D.shape(2) <= X.shape(2);
  const py::array_t<Scalar>& V = d_narrow ? D : X;
  const py::array_t<Scalar>& W = d_narrow ? X : D;
  const int m = static_cast<int>(V.shape(2)), w = static_cast<int>(W.shape(2));
  const std::vector<int> picked = picked_samples(lengths, rows, N, T);
  const int K = static_cast<int>(picked.size());
  const int64_t* len = lengths.data();
  const auto tasks = split_tasks(picked, len, m >= 2);
  std::vector<std::vector<double>> shared(K);  // a split sample's H, written by both of its tasks
  for (const auto& [k, part] : tasks)
    if (part == 0) shared[k].resize(static_cast<size_t>(m) * w);
  std::vector<std::atomic<int>> done(K);
  for (auto& count : done) count = 0;
  const auto vs = V.strides(), ws = W.strides();
  const char* v_base = reinterpret_cast<const char*>(V.data());
  const char* w_base = reinterpret_cast<const char*>(W.data());
  py::array_t<double> out({K, m, m});
  double* o = out.mutable_data();
  const int h = m / 2;  // a split sample's first task: H's rows [0, h)
  parallel_for(static_cast<int>(tasks.size()), threads, [&](int task, SymmetricEigen& scratch) {
    const int k = tasks[task].first, part = tasks[task].second;
    const int i = picked[k], n = static_cast<int>(len[i]);
    double* gram = o + static_cast<size_t>(k) * m * m;  // column-major, leading dimension m
    if (n == 0) {
      std::fill(gram, gram + static_cast<size_t>(m) * m, 0.0);
      return;
    }
    // Row-major n x m (n x w) rows are column-major m x n (w x n): H = Vc Wc^T, column-major m x w.
    rows_as_double<Scalar>(v_base + i * vs[0], vs, n, m, scratch.y);
    rows_as_double<Scalar>(w_base + i * ws[0], ws, n, w, scratch.x);
    double* H = part < 0 ? sized(scratch.g, static_cast<size_t>(m) * w).data() : shared[k].data();
    const int first = part == 1 ? h : 0, count = part < 0 ? m : (part == 0 ? h : m - h);
    char nn = 'N', tr = 'T', lower = 'L';
    int m_ = m, w_ = w, n_ = n, c_ = count;
    double one = 1.0, zero = 0.0;
    dgemm_(&nn, &tr, &c_, &w_, &n_, &one, scratch.y.data() + first, &m_, scratch.x.data(), &w_, &zero, H + first,
           &m_);
    double* block = gram + static_cast<size_t>(first) * m + first;
    dsyrk_(&lower, &nn, &c_, &w_, &one, H + first, &m_, &zero, block, &m_);
    if (part >= 0 && ++done[k] < 2) return;
    if (part >= 0) {  // the block between the halves: rows [h, m), columns [0, h)
      int below = m - h, left = h;
      dgemm_(&nn, &tr, &below, &left, &w_, &one, H + h, &m_, H, &m_, &zero, gram + h, &m_);
    }
    finish_gram(gram, m, m, nullptr);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "gradspec batched spectral reductions (LAPACK via SciPy, threads over the batch)";
  py::register_exception<LapackError>(m, "LapackError", PyExc_RuntimeError);
  m.def("bind_lapack", &bind_lapack, py::arg("dsyevd"), py::arg("dpstrf"), py::arg("dpotrf"), py::arg("dgemm"),
        py::arg("dsyrk"), py::arg("dtrmm"),
        py::arg("mkl_set_num_threads_local") = 0,
        "Bind LAPACK dsyevd, dpstrf, dpotrf and BLAS dgemm, dsyrk, dtrmm by address (Fortran calling convention, 32-bit\n"
        "ints).");
  m.def("segment_gram", &segment_gram<float>, py::arg("Y"), py::arg("lengths"), py::arg("other"), py::arg("threads"),
        py::arg("rows") = py::none(),
        "(fp64 Gram Y_i Y_i^T over each picked sample's first lengths[i] rows of Y (N, T, d), zero-padded to\n"
        "(K, T, T); <Gram_k, other_k> (K,) where other (K, T, T) is given, else None); rows (K,) the samples\n"
        "picked, None for all.");
  m.def("segment_gram", &segment_gram<double>, py::arg("Y"), py::arg("lengths"), py::arg("other"), py::arg("threads"),
        py::arg("rows") = py::none());
  m.def("product_gram", &product_gram<float>, py::arg("D"), py::arg("X"), py::arg("lengths"), py::arg("rows"),
        py::arg("threads"),
        "(K, m, m) fp64 Gram of G = D_i^T X_i over each picked sample's first lengths[i] rows, D (N, T, p) and X\n"
        "(N, T, q): G G^T where p <= q, else G^T G (m = min(p, q)); rows (K,) the samples picked.");
  m.def("product_gram", &product_gram<double>, py::arg("D"), py::arg("X"), py::arg("lengths"), py::arg("rows"),
        py::arg("threads"));
  const double eps64 = std::numeric_limits<double>::epsilon();
  m.def("gram_spectra", &gram_spectra, py::arg("grams"), py::arg("threads"), py::arg("eps") = eps64,
        py::arg("terms") = 0,
        "Singular values (descending, zero-padded) of G from a batch (N, n, n) of its Grams.");
  m.def("gram_spectra_groups", &gram_spectra_groups, py::arg("grams"), py::arg("terms"), py::arg("threads"),
        py::arg("eps") = eps64,
        "gram_spectra of several groups in one job over all their samples: grams[g] (N_g, n_g, n_g), terms[g];\n"
        "returns each group's sigma (N_g, n_g).");
  m.def("core_spectra", &core_spectra, py::arg("B"), py::arg("A"), py::arg("lengths"), py::arg("threads"),
        py::arg("eps") = eps64, py::arg("terms") = 0,
        "Singular values (N, M, T) of G_ij = D_ij^T X_i from B = X X^T (N,T,T), A = D D^T (N,M,T,T)\n"
        "and each sample's token count (N,).");
  m.def("core_spectra_groups", &core_spectra_groups, py::arg("Bs"), py::arg("As"), py::arg("lengths"),
        py::arg("terms"), py::arg("threads"), py::arg("eps") = eps64,
        "core_spectra of several groups in one job over all their samples: Bs[g] (N_g,T_g,T_g), As[g] a list of\n"
        "(N_g,T_g,T_g), lengths[g] (N_g,), terms[g]; returns each group's sigma (N_g, M_g, T_g).");
}

// One-pass CPU kernels for the Adam and AdaMax steps, called through jax.ffi.
//
// Dense (AdamkitCpuStep): XLA:CPU emits an Adam step as three loops (m, v, then the
// parameters), about 40 bytes of memory traffic per float32 parameter. This kernel reads p,
// g, m, v once and writes p, m, v once (28 bytes; AMSGrad's running maximum adds 8), in
// place (the outputs alias the inputs), split over XLA's intra-op thread pool. Variants:
// Adam (two eps placements, Nesterov, AMSGrad, with or without bias correction), AdaMax,
// and no, L2 or decoupled (AdamW) weight decay.
// Row-sparse (AdamkitCpuSparseLazy, AdamkitCpuRowAdd): the lazy step on the rows an
// embedding lookup touched, ids merged in a hash table, each touched row of the table and
// its moments read and written once, rows prefetched ahead; and the row scatter-add.
// The arithmetic mirrors adamkit's reference formulas operation by operation, without FMA
// contraction (the scalars, including reciprocals XLA would form, are computed by the
// caller in JAX).
#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Scalars, float32, in this order (computed in JAX):
//   0 b1, 1 1-b1, 2 b2, 3 1-b2, 4 eps, 5 lr, 6 wd, 7 c1, 8 c2
// Adam, eps_mode "hat":        u = c1 * n / (sqrt(v) + eps)          c1 = sqrt(bc2)/bc1
// Adam, eps_mode "corrected":  u = (n * c1) / (sqrt(v * c2) + eps)   c1 = 1/bc1, c2 = 1/bc2
// AdaMax:                      u = m / (bc1 * (v + eps))             c1 = bc1
// No bias correction (AdamW of MindSpore) is bc1 = bc2 = 1, chosen by the caller.
enum Kind : int64_t { kAdamHat = 0, kAdamCorrected = 1, kAdamax = 2 };
// Weight decay of a leaf: none, L2 in the gradient (g + wd * p, before the moments) or
// decoupled (AdamW: u + wd * p, after the direction, before the learning rate).
enum Decay : int64_t { kNoDecay = 0, kL2 = 1, kDecoupled = 2 };

// The number of state buffers: first and second moment, and AMSGrad's running maximum of
// the raw second moment. The Python caller (adamkit/_cpu/ffi.py) passes the same count as
// the `state` attribute, and the handlers check it.
constexpr int64_t StateBuffers(bool amsgrad) { return amsgrad ? 3 : 2; }
constexpr int64_t kMaxStateBuffers = 3;

// store_u: p is an output that receives the direction u (no learning rate, no decay),
// for the sparse kernel's updates; otherwise p is the parameter, updated in place.
// vmax: AMSGrad's running maximum (read and written only when amsgrad).
template <int64_t kind, bool nesterov, int64_t decay, bool amsgrad, bool store_u>
inline __attribute__((always_inline)) void ChunkBody(float* __restrict p, float* __restrict m,
                                                     float* __restrict v,
                                                     float* __restrict vmax,
                                                     const float* __restrict g, const float* s,
                                                     int64_t lo, int64_t hi) {
  static_assert(!(store_u && decay != kNoDecay), "the direction output takes no decay");
  static_assert(!(amsgrad && kind == kAdamax), "AdaMax has no AMSGrad form");
  const float b1 = s[0], omb1 = s[1], b2 = s[2], omb2 = s[3], eps = s[4], lr = s[5],
              wd = s[6], c1 = s[7], c2 = s[8];
  for (int64_t i = lo; i < hi; ++i) {
    float gi = g[i];
    if (decay == kL2) gi = gi + wd * p[i];
    float mi = b1 * m[i] + omb1 * gi;
    float vi;
    float u;
    if (kind == kAdamax) {
      vi = std::max(b2 * v[i], std::fabs(gi));
      u = mi / (c1 * (vi + eps));
    } else {
      vi = b2 * v[i] + omb2 * (gi * gi);
      float den = vi;
      if (amsgrad) {
        // max(vmax, v) with NaN propagated from either side, as jnp.maximum.
        const float old = vmax[i];
        den = (vi != vi || vi > old) ? vi : old;
        vmax[i] = den;
      }
      float n = nesterov ? b1 * mi + omb1 * gi : mi;
      if (kind == kAdamHat) {
        u = c1 * n / (std::sqrt(den) + eps);
      } else {
        u = (n * c1) / (std::sqrt(den * c2) + eps);
      }
    }
    m[i] = mi;
    v[i] = vi;
    if (store_u) {
      p[i] = u;
    } else {
      if (decay == kDecoupled) u = u + wd * p[i];
      p[i] = p[i] + (-lr * u);
    }
  }
}

// The loop compiled twice: for the architecture's baseline and, on x86-64, for AVX2
// (chosen at run time). Same operations, same rounding (no FMA): only the vector width
// differs, which matters once the memory is fast enough to make sqrt and division count.
template <int64_t kind, bool nesterov, int64_t decay, bool amsgrad, bool store_u>
void Chunk(float* p, float* m, float* v, float* vmax, const float* g, const float* s,
           int64_t lo, int64_t hi) {
  ChunkBody<kind, nesterov, decay, amsgrad, store_u>(p, m, v, vmax, g, s, lo, hi);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define ADAMKIT_AVX2 1
template <int64_t kind, bool nesterov, int64_t decay, bool amsgrad, bool store_u>
__attribute__((target("avx2"))) void ChunkAvx2(float* p, float* m, float* v, float* vmax,
                                               const float* g, const float* s, int64_t lo,
                                               int64_t hi) {
  ChunkBody<kind, nesterov, decay, amsgrad, store_u>(p, m, v, vmax, g, s, lo, hi);
}

bool HasAvx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return has;
}
#endif

using ChunkFn = void (*)(float*, float*, float*, float*, const float*, const float*, int64_t,
                         int64_t);

template <int64_t kind, bool nesterov, int64_t decay, bool amsgrad, bool store_u>
ChunkFn Instance() {
#ifdef ADAMKIT_AVX2
  if (HasAvx2()) return ChunkAvx2<kind, nesterov, decay, amsgrad, store_u>;
#endif
  return Chunk<kind, nesterov, decay, amsgrad, store_u>;
}

// The variant's loop, instantiated only for the combinations that exist (the handlers
// refuse the others first): store_u without decay, AMSGrad and Nesterov for Adam only.
template <int64_t kind, bool nesterov, int64_t decay, bool amsgrad>
ChunkFn PickStore(bool store_u) {
  if constexpr (decay == kNoDecay) {
    if (store_u) return Instance<kind, nesterov, decay, amsgrad, true>();
  }
  return Instance<kind, nesterov, decay, amsgrad, false>();
}

template <int64_t kind, bool nesterov, int64_t decay>
ChunkFn PickAmsgrad(bool amsgrad, bool store_u) {
  if constexpr (kind != kAdamax) {
    if (amsgrad) return PickStore<kind, nesterov, decay, true>(store_u);
  }
  return PickStore<kind, nesterov, decay, false>(store_u);
}

template <int64_t kind, bool nesterov>
ChunkFn PickDecay(int64_t decay, bool amsgrad, bool store_u) {
  if (decay == kL2) return PickAmsgrad<kind, nesterov, kL2>(amsgrad, store_u);
  if (decay == kDecoupled) return PickAmsgrad<kind, nesterov, kDecoupled>(amsgrad, store_u);
  return PickAmsgrad<kind, nesterov, kNoDecay>(amsgrad, store_u);
}

template <int64_t kind>
ChunkFn PickNesterov(bool nesterov, int64_t decay, bool amsgrad, bool store_u) {
  if constexpr (kind != kAdamax) {
    if (nesterov) return PickDecay<kind, true>(decay, amsgrad, store_u);
  }
  return PickDecay<kind, false>(decay, amsgrad, store_u);
}

ChunkFn Pick(int64_t kind, bool nesterov, int64_t decay, bool amsgrad, bool store_u = false) {
  return kind == kAdamHat ? PickNesterov<kAdamHat>(nesterov, decay, amsgrad, store_u)
       : kind == kAdamCorrected ? PickNesterov<kAdamCorrected>(nesterov, decay, amsgrad, store_u)
                                : PickNesterov<kAdamax>(nesterov, decay, amsgrad, store_u);
}

// The variant attributes every handler checks before touching a buffer.
bool ValidVariant(int64_t kind, bool nesterov, int64_t decay, bool amsgrad, int64_t state) {
  return kind >= kAdamHat && kind <= kAdamax && decay >= kNoDecay && decay <= kDecoupled &&
         !((amsgrad || nesterov) && kind == kAdamax) && state == StateBuffers(amsgrad);
}

int64_t Threads(ffi::ThreadPool& pool) { return std::max<int64_t>(pool.num_threads(), 1); }

// Calls body(lo, hi) over [0, total) in chunks of `chunk` items, on the calling thread and
// on helpers scheduled on XLA's intra-op pool. A single chunk runs inline. Chunks are
// claimed from a shared counter; the caller waits only for chunks already claimed, which are
// running: a helper that starts late (the pool busy, e.g. with another call of a kernel)
// finds no work and returns, so a kernel cannot deadlock on its own pool. The shared state
// lives on the heap because a helper may start after the call has returned (it then touches
// the counters only, never `body`).
template <typename Body>
void ParallelFor(ffi::ThreadPool& pool, int64_t total, int64_t chunk, const Body& body) {
  const int64_t chunks = (total + chunk - 1) / chunk;
  const int64_t threads = Threads(pool);
  if (chunks <= 1 || threads <= 1) {
    if (total > 0) body(0, total);
    return;
  }
  struct Work {
    std::function<void(int64_t, int64_t)> body;
    int64_t total, chunk, chunks;
    std::atomic<int64_t> next{0}, done{0};
  };
  auto work = std::make_shared<Work>();
  work->body = body;
  work->total = total;
  work->chunk = chunk;
  work->chunks = chunks;
  auto drain = [](Work& w) {
    for (int64_t c; (c = w.next.fetch_add(1, std::memory_order_relaxed)) < w.chunks;) {
      w.body(c * w.chunk, std::min(w.total, (c + 1) * w.chunk));
      w.done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < std::min(threads, chunks); ++t) {
    pool.Schedule([work, drain] { drain(*work); });
  }
  drain(*work);
  while (work->done.load(std::memory_order_acquire) < work->chunks) std::this_thread::yield();
}

struct Leaf {
  float* p;
  float* m;
  float* v;
  float* vmax;  // nullptr without AMSGrad
  const float* g;
  int64_t n;
};

// Runs `fn` over the global element range [lo, hi) of the concatenated leaves.
void RunRange(ChunkFn fn, const std::vector<Leaf>& leaves, const float* s, int64_t lo,
              int64_t hi) {
  int64_t base = 0;
  for (const Leaf& l : leaves) {
    int64_t a = std::max(lo, base), b = std::min(hi, base + l.n);
    if (a < b) fn(l.p, l.m, l.v, l.vmax, l.g, s, a - base, b - base);
    base += l.n;
    if (base >= hi) break;
  }
}

// Arguments: scalars (f32[9]), then L params and L gradients (float32, any shape), then
// the `state` buffers (first moment, second moment and, with AMSGrad, the running maximum
// of the second moment), each one flat float32 buffer in which the L leaves lie back to
// back from element `offset` (multi-tensor mode; one leaf: its own moments, offset 0).
// Results: the L params and the state buffers, aliased to the inputs when the caller
// donates them (otherwise fresh buffers, filled from the inputs first).
// Every buffer is checked against its own size: nothing is read or written outside it.
ffi::Error Step(ffi::ThreadPool pool, ffi::BufferR1<ffi::F32> scalars, ffi::RemainingArgs args,
                ffi::RemainingRets rets, int64_t kind, bool nesterov, int64_t decay,
                bool amsgrad, int64_t offset, int64_t state) {
  if (scalars.element_count() != 9) {
    return ffi::Error::InvalidArgument("adamkit cpu step: expected 9 scalars");
  }
  if (!ValidVariant(kind, nesterov, decay, amsgrad, state)) {
    return ffi::Error::InvalidArgument("adamkit cpu step: unknown variant or state count");
  }
  const size_t nstate = static_cast<size_t>(state);
  if (args.size() < 2 + nstate || (args.size() - nstate) % 2 != 0 ||
      rets.size() != (args.size() - nstate) / 2 + nstate) {
    return ffi::Error::InvalidArgument(
        "adamkit cpu step: expected 2L+S arguments, L+S results (S state buffers)");
  }
  if (offset < 0) return ffi::Error::InvalidArgument("adamkit cpu step: negative offset");
  const size_t num = (args.size() - nstate) / 2;
  float* moments[kMaxStateBuffers] = {nullptr, nullptr, nullptr};
  int64_t moment_size[kMaxStateBuffers] = {0, 0, 0};
  for (size_t k = 0; k < nstate; ++k) {
    auto in = args.get<ffi::Buffer<ffi::F32>>(2 * num + k);
    auto out = rets.get<ffi::Buffer<ffi::F32>>(num + k);
    if (in.has_error()) return in.error();
    if (out.has_error()) return out.error();
    moment_size[k] = static_cast<int64_t>(in->element_count());
    if (static_cast<int64_t>((*out)->element_count()) != moment_size[k]) {
      return ffi::Error::InvalidArgument("adamkit cpu step: a moment result differs from its input");
    }
    moments[k] = (*out)->typed_data();
    if (moments[k] != in->typed_data()) std::copy_n(in->typed_data(), moment_size[k], moments[k]);
  }
  std::vector<Leaf> leaves(num);
  int64_t total = 0;
  for (size_t i = 0; i < num; ++i) {
    auto p = args.get<ffi::Buffer<ffi::F32>>(i);
    auto g = args.get<ffi::Buffer<ffi::F32>>(num + i);
    auto p_out = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (p.has_error()) return p.error();
    if (g.has_error()) return g.error();
    if (p_out.has_error()) return p_out.error();
    const int64_t n = static_cast<int64_t>(p->element_count());
    if (static_cast<int64_t>(g->element_count()) != n ||
        static_cast<int64_t>((*p_out)->element_count()) != n) {
      return ffi::Error::InvalidArgument("adamkit cpu step: a gradient differs from its param");
    }
    for (size_t k = 0; k < nstate; ++k) {
      if (offset + total + n > moment_size[k]) {
        return ffi::Error::InvalidArgument(
            "adamkit cpu step: a moment buffer is smaller than its params");
      }
    }
    float* po = (*p_out)->typed_data();
    if (po != p->typed_data()) std::copy_n(p->typed_data(), n, po);
    const int64_t at = offset + total;
    leaves[i] = Leaf{po, moments[0] + at, moments[1] + at, amsgrad ? moments[2] + at : nullptr,
                     g->typed_data(), n};
    total += n;
  }
  ChunkFn fn = Pick(kind, nesterov, decay, amsgrad);
  const float* s = scalars.typed_data();

  // Small steps run on the calling thread: scheduling costs more than it saves.
  constexpr int64_t kMinPerChunk = 1 << 16;
  if (total < 2 * kMinPerChunk) {
    RunRange(fn, leaves, s, 0, total);
    return ffi::Error::Success();
  }
  const int64_t chunk = std::max<int64_t>(kMinPerChunk, (total / (4 * Threads(pool))) &
                                                           ~int64_t{15});
  ParallelFor(pool, total, chunk, [&leaves, fn, s](int64_t lo, int64_t hi) {
    RunRange(fn, leaves, s, lo, hi);
  });
  return ffi::Error::Success();
}

// The lazy sparse step (MindSpore FusedSparseLazyAdam): Adam on the distinct rows named by
// `ids` only, each row's table and state read and written once, in place.
//
// Arguments: scalars (f32[9], as above; lr and wd unused when apply is false), ids (s32[k]),
// gradient rows (f32[k, *row]), the `state` buffers m, v and, with AMSGrad, vmax (the
// table's state: `num_rows` rows from element `offset` of each buffer, which may hold
// other leaves too) and, when `apply`, the table (f32[num_rows, *row]). Results: the state
// buffers, then the table (apply) or, without apply, the distinct ids (s32[k]:
// first-occurrence order, then num_rows in unused slots) and their directions u
// (f32[k, *row], zeros in unused slots). Ids outside [0, num_rows) are skipped (MindSpore
// drops them). With `merge`, duplicate ids are summed in the order they occur (as a
// scatter-add does) into one row; without it each occurrence is its own row (the caller
// promised unique ids). `decay` (apply only): kDecoupled adds wd * w to each touched row's
// direction once (lazy AdamW); an L2 decay of sparse rows is the caller's, per occurrence.
ffi::Error SparseLazy(ffi::ThreadPool pool, ffi::BufferR1<ffi::F32> scalars,
                      ffi::BufferR1<ffi::S32> ids, ffi::Buffer<ffi::F32> grad,
                      ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t kind,
                      bool nesterov, int64_t decay, bool amsgrad, int64_t state, bool apply,
                      bool merge, int64_t offset, int64_t rows) {
  if (scalars.element_count() != 9) {
    return ffi::Error::InvalidArgument("adamkit sparse step: expected 9 scalars");
  }
  if (!ValidVariant(kind, nesterov, decay, amsgrad, state) || decay == kL2 ||
      (decay == kDecoupled && !apply)) {
    return ffi::Error::InvalidArgument("adamkit sparse step: unknown variant or state count");
  }
  const size_t nstate = static_cast<size_t>(state);
  if (args.size() != nstate + (apply ? 1u : 0u) || rets.size() != nstate + (apply ? 1u : 2u)) {
    return ffi::Error::InvalidArgument("adamkit sparse step: wrong number of operands");
  }
  if (rows < 0 || rows > INT32_MAX || offset < 0) {
    return ffi::Error::InvalidArgument("adamkit sparse step: bad row count or offset");
  }
  // Sizes from each buffer's own dimensions: k from the ids, the row width from the
  // gradient rows' shape (not from a division, which a short gradient would fool).
  const int64_t k = static_cast<int64_t>(ids.element_count());
  const auto dims = grad.dimensions();
  if (dims.size() < 1 || dims[0] != k || k > INT32_MAX) {
    return ffi::Error::InvalidArgument("adamkit sparse step: gradient rows do not match ids");
  }
  int64_t width = 1;
  for (size_t d = 1; d < dims.size(); ++d) width *= dims[d];
  if (width * k != static_cast<int64_t>(grad.element_count())) {
    return ffi::Error::InvalidArgument("adamkit sparse step: gradient rows do not match ids");
  }
  float* bufs[kMaxStateBuffers + 1] = {nullptr, nullptr, nullptr, nullptr};  // state, table
  for (size_t j = 0; j < args.size(); ++j) {
    auto in = args.get<ffi::Buffer<ffi::F32>>(j);
    auto out = rets.get<ffi::Buffer<ffi::F32>>(j);
    if (in.has_error()) return in.error();
    if (out.has_error()) return out.error();
    const int64_t n = static_cast<int64_t>(in->element_count());
    const bool ok = j < nstate ? offset + rows * width <= n : n == rows * width;
    if (!ok || static_cast<int64_t>((*out)->element_count()) != n) {
      return ffi::Error::InvalidArgument(
          j == 0   ? "adamkit sparse step: the first moment is smaller than the table"
          : j == 1 ? "adamkit sparse step: the second moment is smaller than the table"
          : j < nstate
              ? "adamkit sparse step: the running maximum is smaller than the table"
              : "adamkit sparse step: the table is not num_rows rows of the gradient's width");
    }
    bufs[j] = (*out)->typed_data();
    if (bufs[j] != in->typed_data()) std::copy_n(in->typed_data(), n, bufs[j]);
  }
  const int32_t* id = ids.typed_data();
  const float* g = grad.typed_data();

  // Distinct valid ids in first-occurrence order; next[pos] chains later occurrences.
  std::vector<int32_t> uid, first, last;
  std::vector<int32_t> next(k, -1);
  uid.reserve(k);
  first.reserve(k);
  if (merge) {
    int shift = 32;
    int64_t cap = 1;
    while (cap < 2 * k) cap <<= 1, --shift;
    std::vector<int32_t> slot(cap, -1);
    last.reserve(k);
    for (int64_t pos = 0; pos < k; ++pos) {
      const int32_t i = id[pos];
      if (i < 0 || i >= rows) continue;
      uint32_t h = shift < 32 ? (static_cast<uint32_t>(i) * 2654435761u) >> shift : 0;
      while (slot[h] >= 0 && uid[slot[h]] != i) h = (h + 1) & (cap - 1);
      if (slot[h] < 0) {
        slot[h] = static_cast<int32_t>(uid.size());
        uid.push_back(i);
        first.push_back(static_cast<int32_t>(pos));
        last.push_back(static_cast<int32_t>(pos));
      } else {
        next[last[slot[h]]] = static_cast<int32_t>(pos);
        last[slot[h]] = static_cast<int32_t>(pos);
      }
    }
  } else {
    for (int64_t pos = 0; pos < k; ++pos) {
      if (id[pos] >= 0 && id[pos] < rows) {
        uid.push_back(id[pos]);
        first.push_back(static_cast<int32_t>(pos));
      }
    }
  }
  const int64_t distinct = static_cast<int64_t>(uid.size());

  float* u_out = nullptr;
  if (!apply) {
    auto ids_out = rets.get<ffi::Buffer<ffi::S32>>(nstate);
    auto dir = rets.get<ffi::Buffer<ffi::F32>>(nstate + 1);
    if (ids_out.has_error()) return ids_out.error();
    if (dir.has_error()) return dir.error();
    if (static_cast<int64_t>((*ids_out)->element_count()) != k ||
        static_cast<int64_t>((*dir)->element_count()) != k * width) {
      return ffi::Error::InvalidArgument("adamkit sparse step: result sizes do not match ids");
    }
    int32_t* io = (*ids_out)->typed_data();
    std::copy(uid.begin(), uid.end(), io);
    std::fill(io + distinct, io + k, static_cast<int32_t>(rows));
    u_out = (*dir)->typed_data();
    std::fill(u_out + distinct * width, u_out + k * width, 0.0f);
  }

  ChunkFn fn = Pick(kind, nesterov, decay, amsgrad, /*store_u=*/!apply);
  const float* s = scalars.typed_data();
  float* m = bufs[0] + offset;
  float* v = bufs[1] + offset;
  float* vmax = amsgrad ? bufs[2] + offset : nullptr;
  float* p = bufs[nstate];
  const int64_t lines = std::min<int64_t>((width * 4 + 63) / 64, 16);
  auto body = [&](int64_t lo, int64_t hi) {
    std::vector<float> acc;
    constexpr int64_t kAhead = 4;  // rows prefetched ahead: random rows miss every cache
    for (int64_t r = lo; r < hi; ++r) {
      if (r + kAhead < hi) {
        const int64_t at = static_cast<int64_t>(uid[r + kAhead]) * width;
        for (int64_t c = 0; c < lines; ++c) {
          __builtin_prefetch(m + at + 16 * c, 1);
          __builtin_prefetch(v + at + 16 * c, 1);
          if (amsgrad) __builtin_prefetch(vmax + at + 16 * c, 1);
          if (apply) __builtin_prefetch(p + at + 16 * c, 1);
        }
      }
      const float* row = g + static_cast<int64_t>(first[r]) * width;
      if (merge && next[first[r]] >= 0) {
        acc.assign(row, row + width);
        for (int32_t q = next[first[r]]; q >= 0; q = next[q]) {
          const float* more = g + static_cast<int64_t>(q) * width;
          for (int64_t j = 0; j < width; ++j) acc[j] = acc[j] + more[j];
        }
        row = acc.data();
      }
      const int64_t at = static_cast<int64_t>(uid[r]) * width;
      fn(apply ? p + at : u_out + r * width, m + at, v + at, amsgrad ? vmax + at : nullptr, row,
         s, 0, width);
    }
  };
  // Split over the pool only when there is enough work (about 64k floats per chunk).
  const int64_t per_chunk = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(width, 1));
  ParallelFor(pool, distinct, std::max(per_chunk, (distinct + Threads(pool) - 1) / Threads(pool)),
              body);
  return ffi::Error::Success();
}

// The row scatter-add of adamkit.apply_updates: table[ids[i]] += rows[i] for each i in
// order (repeated ids add up, as XLA's scatter-add; ids outside [0, N) are skipped), in
// place when the caller donates the table. One thread: k rows are little work, and rows
// with repeated ids must not race.
ffi::Error RowAdd(ffi::BufferR1<ffi::S32> ids, ffi::Buffer<ffi::F32> rows_in,
                  ffi::Buffer<ffi::F32> table, ffi::ResultBuffer<ffi::F32> out) {
  // The table's rows and width from its own shape, k from the ids; the update rows must
  // be k rows of that width.
  const int64_t k = static_cast<int64_t>(ids.element_count());
  const int64_t size = static_cast<int64_t>(table.element_count());
  const auto tdims = table.dimensions();
  const auto rdims = rows_in.dimensions();
  if (tdims.size() < 1 || rdims.size() != tdims.size() || rdims[0] != k) {
    return ffi::Error::InvalidArgument("adamkit row add: rows do not match ids");
  }
  int64_t width = 1;
  for (size_t d = 1; d < tdims.size(); ++d) {
    if (rdims[d] != tdims[d]) {
      return ffi::Error::InvalidArgument("adamkit row add: rows do not match the table's rows");
    }
    width *= tdims[d];
  }
  if (static_cast<int64_t>(out->element_count()) != size) {
    return ffi::Error::InvalidArgument("adamkit row add: result differs from the table");
  }
  float* p = out->typed_data();
  if (p != table.typed_data()) std::copy_n(table.typed_data(), size, p);
  const int64_t rows = tdims[0];
  if (width == 0 || rows == 0) return ffi::Error::Success();
  const int32_t* id = ids.typed_data();
  const float* u = rows_in.typed_data();
  const int64_t lines = std::min<int64_t>((width * 4 + 63) / 64, 16);
  constexpr int64_t kAhead = 4;
  for (int64_t r = 0; r < k; ++r) {
    if (r + kAhead < k && id[r + kAhead] >= 0 && id[r + kAhead] < rows) {
      const int64_t at = static_cast<int64_t>(id[r + kAhead]) * width;
      for (int64_t c = 0; c < lines; ++c) __builtin_prefetch(p + at + 16 * c, 1);
    }
    const int32_t i = id[r];
    if (i < 0 || i >= rows) continue;
    float* dst = p + static_cast<int64_t>(i) * width;
    const float* src = u + r * width;
    for (int64_t j = 0; j < width; ++j) dst[j] = dst[j] + src[j];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AdamkitCpuStep, Step,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR1<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("kind")
                                  .Attr<bool>("nesterov")
                                  .Attr<int64_t>("decay")
                                  .Attr<bool>("amsgrad")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("state"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(AdamkitCpuSparseLazy, SparseLazy,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR1<ffi::F32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("kind")
                                  .Attr<bool>("nesterov")
                                  .Attr<int64_t>("decay")
                                  .Attr<bool>("amsgrad")
                                  .Attr<int64_t>("state")
                                  .Attr<bool>("apply")
                                  .Attr<bool>("merge")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("num_rows"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(AdamkitCpuRowAdd, RowAdd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

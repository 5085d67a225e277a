// One-pass CPU kernels for the Adam and AdaMax steps, called through jax.ffi.
//
// XLA:CPU emits an Adam step as three loops (m, v, then the parameters), about 40 bytes of
// memory traffic per float32 parameter. These kernels read p, g, m, v once and write p, m,
// v once (28 bytes), in place (the outputs alias the inputs), split over XLA's intra-op
// thread pool. The arithmetic mirrors adamkit's reference formulas operation by operation
// (the scalars, including reciprocals XLA would form, are computed by the caller in JAX).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
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
enum Kind : int64_t { kAdamHat = 0, kAdamCorrected = 1, kAdamax = 2 };

template <int64_t kind, bool nesterov, bool decay>
inline __attribute__((always_inline)) void ChunkBody(float* __restrict p, float* __restrict m,
                                                     float* __restrict v,
                                                     const float* __restrict g, const float* s,
                                                     int64_t lo, int64_t hi) {
  const float b1 = s[0], omb1 = s[1], b2 = s[2], omb2 = s[3], eps = s[4], lr = s[5],
              wd = s[6], c1 = s[7], c2 = s[8];
  for (int64_t i = lo; i < hi; ++i) {
    float gi = g[i];
    if (decay) gi = gi + wd * p[i];
    float mi = b1 * m[i] + omb1 * gi;
    float vi;
    float u;
    if (kind == kAdamax) {
      vi = std::max(b2 * v[i], std::fabs(gi));
      u = mi / (c1 * (vi + eps));
    } else {
      vi = b2 * v[i] + omb2 * (gi * gi);
      float n = nesterov ? b1 * mi + omb1 * gi : mi;
      if (kind == kAdamHat) {
        u = c1 * n / (std::sqrt(vi) + eps);
      } else {
        u = (n * c1) / (std::sqrt(vi * c2) + eps);
      }
    }
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] + (-lr * u);
  }
}

// The loop compiled twice: for the architecture's baseline and, on x86-64, for AVX2
// (chosen at run time). Same operations, same rounding (no FMA): only the vector width
// differs, which matters once the memory is fast enough to make sqrt and division count.
template <int64_t kind, bool nesterov, bool decay>
void Chunk(float* p, float* m, float* v, const float* g, const float* s, int64_t lo,
           int64_t hi) {
  ChunkBody<kind, nesterov, decay>(p, m, v, g, s, lo, hi);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define ADAMKIT_AVX2 1
template <int64_t kind, bool nesterov, bool decay>
__attribute__((target("avx2"))) void ChunkAvx2(float* p, float* m, float* v, const float* g,
                                               const float* s, int64_t lo, int64_t hi) {
  ChunkBody<kind, nesterov, decay>(p, m, v, g, s, lo, hi);
}

bool HasAvx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return has;
}
#endif

using ChunkFn = void (*)(float*, float*, float*, const float*, const float*, int64_t, int64_t);

template <int64_t kind>
ChunkFn Pick(bool nesterov, bool decay) {
#ifdef ADAMKIT_AVX2
  if (HasAvx2()) {
    if (nesterov) return decay ? ChunkAvx2<kind, true, true> : ChunkAvx2<kind, true, false>;
    return decay ? ChunkAvx2<kind, false, true> : ChunkAvx2<kind, false, false>;
  }
#endif
  if (nesterov) return decay ? Chunk<kind, true, true> : Chunk<kind, true, false>;
  return decay ? Chunk<kind, false, true> : Chunk<kind, false, false>;
}

struct Leaf {
  float* p;
  float* m;
  float* v;
  const float* g;
  int64_t n;
};

// Runs `fn` over the global element range [lo, hi) of the concatenated leaves.
void RunRange(ChunkFn fn, const std::vector<Leaf>& leaves, const float* s, int64_t lo,
              int64_t hi) {
  int64_t base = 0;
  for (const Leaf& l : leaves) {
    int64_t a = std::max(lo, base), b = std::min(hi, base + l.n);
    if (a < b) fn(l.p, l.m, l.v, l.g, s, a - base, b - base);
    base += l.n;
    if (base >= hi) break;
  }
}

// Arguments: scalars (f32[9]), then L params and L gradients (float32, any shape), then
// the first and second moments, each one flat float32 buffer in which the L leaves lie
// back to back from element `offset` (multi-tensor mode; one leaf: its own moments, offset
// 0). Results: the L params and the two moment buffers, aliased to the inputs when the
// caller donates them (otherwise fresh buffers, filled from the inputs first).
ffi::Error Step(ffi::ThreadPool pool, ffi::BufferR1<ffi::F32> scalars, ffi::RemainingArgs args,
                ffi::RemainingRets rets, int64_t kind, bool nesterov, bool decay,
                int64_t offset) {
  if (scalars.element_count() != 9) {
    return ffi::Error::InvalidArgument("adamkit cpu step: expected 9 scalars");
  }
  if (args.size() < 4 || args.size() % 2 != 0 || rets.size() != args.size() / 2 + 1) {
    return ffi::Error::InvalidArgument("adamkit cpu step: expected 2L+2 arguments, L+2 results");
  }
  const size_t num = (args.size() - 2) / 2;
  float* moments[2];
  int64_t moment_size = 0;
  for (size_t k = 0; k < 2; ++k) {
    auto in = args.get<ffi::Buffer<ffi::F32>>(2 * num + k);
    auto out = rets.get<ffi::Buffer<ffi::F32>>(num + k);
    if (in.has_error()) return in.error();
    if (out.has_error()) return out.error();
    moment_size = static_cast<int64_t>(in->element_count());
    moments[k] = (*out)->typed_data();
    if (moments[k] != in->typed_data()) std::copy_n(in->typed_data(), moment_size, moments[k]);
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
    if (static_cast<int64_t>(g->element_count()) != n) {
      return ffi::Error::InvalidArgument("adamkit cpu step: a gradient differs from its param");
    }
    if (offset + total + n > moment_size) {
      return ffi::Error::InvalidArgument("adamkit cpu step: moment buffers too small");
    }
    float* po = (*p_out)->typed_data();
    if (po != p->typed_data()) std::copy_n(p->typed_data(), n, po);
    leaves[i] = Leaf{po, moments[0] + offset + total, moments[1] + offset + total,
                     g->typed_data(), n};
    total += n;
  }
  ChunkFn fn = kind == kAdamHat ? Pick<kAdamHat>(nesterov, decay)
             : kind == kAdamCorrected ? Pick<kAdamCorrected>(nesterov, decay)
                                      : Pick<kAdamax>(nesterov, decay);
  const float* s = scalars.typed_data();

  // Small steps run on the calling thread: scheduling costs more than it saves.
  constexpr int64_t kMinPerChunk = 1 << 16;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  if (threads <= 1 || total < 2 * kMinPerChunk) {
    RunRange(fn, leaves, s, 0, total);
    return ffi::Error::Success();
  }
  // Chunks of the concatenated leaves (cut on 16-float cache-line boundaries) are claimed
  // from a shared counter by the calling thread and by helpers scheduled on XLA's pool. The
  // caller waits only for chunks already claimed, which are running: a helper that starts
  // late (the pool busy, e.g. with another call of this kernel) finds no work and returns,
  // so the kernel cannot deadlock on its own pool. The shared state lives on the heap
  // because a helper may start after the call has returned.
  struct Work {
    std::vector<Leaf> leaves;
    ChunkFn fn;
    const float* s;
    int64_t total, chunk, chunks;
    std::atomic<int64_t> next{0}, done{0};
  };
  auto work = std::make_shared<Work>();
  work->leaves = std::move(leaves);
  work->fn = fn;
  work->s = s;
  work->total = total;
  work->chunk = std::max<int64_t>(kMinPerChunk, (total / (4 * threads)) & ~int64_t{15});
  work->chunks = (total + work->chunk - 1) / work->chunk;
  auto drain = [](Work& w) {
    for (int64_t c; (c = w.next.fetch_add(1, std::memory_order_relaxed)) < w.chunks;) {
      RunRange(w.fn, w.leaves, w.s, c * w.chunk, std::min(w.total, (c + 1) * w.chunk));
      w.done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < std::min(threads, work->chunks); ++t) {
    pool.Schedule([work, drain] { drain(*work); });
  }
  drain(*work);
  while (work->done.load(std::memory_order_acquire) < work->chunks) std::this_thread::yield();
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
                                  .Attr<bool>("decay")
                                  .Attr<int64_t>("offset"));

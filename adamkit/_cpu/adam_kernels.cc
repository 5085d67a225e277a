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
// Quantized (AdamkitCpuStepQuantized): the dense step with 8-bit block-wise moments
// (adamkit/_quant.py), decoded, stepped and re-encoded per block in one pass.
// Rounded (AdamkitCpuStepRounded): the dense step on bfloat16 params without a float32
// master copy, rounded to nearest, stochastically or Kahan-compensated in the same pass.
// The arithmetic mirrors adamkit's reference formulas operation by operation, without FMA
// contraction (the scalars, including reciprocals XLA would form, are computed by the
// caller in JAX).
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

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

// The nine scalars, loaded once per loop (see the table above).
struct Scalars {
  float b1, omb1, b2, omb2, eps, lr, wd, c1, c2;
};

inline Scalars LoadScalars(const float* s) {
  return Scalars{s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8]};
}

// The step of one element: from the gradient and the old moments, the new moments and
// the new parameter (store_u: p receives the direction u, no learning rate, no decay).
// vmax: AMSGrad's running maximum (read and written only when amsgrad).
template <int64_t kind, bool nesterov, int64_t decay, bool amsgrad, bool store_u>
inline __attribute__((always_inline)) void Update(const Scalars& k, float gi, float& p, float& m,
                                                  float& v, float& vmax) {
  static_assert(!(store_u && decay != kNoDecay), "the direction output takes no decay");
  static_assert(!(amsgrad && kind == kAdamax), "AdaMax has no AMSGrad form");
  if (decay == kL2) gi = gi + k.wd * p;
  float mi = k.b1 * m + k.omb1 * gi;
  float vi;
  float u;
  if (kind == kAdamax) {
    // max(b2 v, |g|) with a NaN of either side kept, as jnp.maximum in the XLA step
    const float decayed = k.b2 * v, norm = std::fabs(gi);
    vi = (norm != norm || norm > decayed) ? norm : decayed;
    u = mi / (k.c1 * (vi + k.eps));
  } else {
    vi = k.b2 * v + k.omb2 * (gi * gi);
    float den = vi;
    if (amsgrad) {
      // max(vmax, v) with NaN propagated from either side, as jnp.maximum.
      const float old = vmax;
      den = (vi != vi || vi > old) ? vi : old;
      vmax = den;
    }
    float n = nesterov ? k.b1 * mi + k.omb1 * gi : mi;
    if (kind == kAdamHat) {
      u = k.c1 * n / (std::sqrt(den) + k.eps);
    } else {
      u = (n * k.c1) / (std::sqrt(den * k.c2) + k.eps);
    }
  }
  m = mi;
  v = vi;
  if (store_u) {
    p = u;
  } else {
    if (decay == kDecoupled) u = u + k.wd * p;
    p = p + (-k.lr * u);
  }
}

template <int64_t kind, bool nesterov, int64_t decay, bool amsgrad, bool store_u>
inline __attribute__((always_inline)) void ChunkBody(float* __restrict p, float* __restrict m,
                                                     float* __restrict v,
                                                     float* __restrict vmax,
                                                     const float* __restrict g, const float* s,
                                                     int64_t lo, int64_t hi) {
  const Scalars k = LoadScalars(s);
  for (int64_t i = lo; i < hi; ++i) {
    float none = 0.0f;
    Update<kind, nesterov, decay, amsgrad, store_u>(k, g[i], p[i], m[i], v[i],
                                                    amsgrad ? vmax[i] : none);
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

// ------------------------------------------------------------------ checks of a call
// Every handler checks its attributes and each buffer against that buffer's own size before
// it reads or writes any, and every check is free of overflow: a value is first checked to
// be in range (non-negative, at most a size), then compared with a difference (`n <= size -
// at`), never with a sum (`at + n <= size`, which an attribute near INT64_MAX wraps). A
// malformed call (a direct jax.ffi.ffi_call) gets an InvalidArgument error naming the
// attribute or buffer and the accepted range.

// Whether [at, at + n) lies within [0, size), all three non-negative (overflow-free).
inline bool Fits(int64_t at, int64_t n, int64_t size) {
  return at >= 0 && n >= 0 && size >= 0 && at <= size && n <= size - at;
}

// The product of dims[from:] in *out; false when it overflows int64 or a dimension is
// negative (a zero-sized buffer may carry any other dimensions).
template <typename Dims>
bool CountOf(const Dims& dims, size_t from, int64_t* out) {
  int64_t n = 1;
  for (size_t d = from; d < dims.size(); ++d) {
    if (dims[d] < 0 || __builtin_mul_overflow(n, static_cast<int64_t>(dims[d]), &n)) return false;
  }
  *out = n;
  return true;
}

std::string Str(int64_t x) { return std::to_string(x); }

// The variant attributes every handler checks before touching a buffer: "" when they are
// valid, else what is wrong (the attribute, its value and the accepted values).
std::string VariantError(int64_t kind, bool nesterov, int64_t decay, bool amsgrad,
                         int64_t state) {
  if (kind < kAdamHat || kind > kAdamax) {
    return "attribute kind = " + Str(kind) + " must be 0 (Adam, hat), 1 (Adam, corrected) or 2 "
           "(AdaMax)";
  }
  if (decay < kNoDecay || decay > kDecoupled) {
    return "attribute decay = " + Str(decay) + " must be 0 (none), 1 (L2) or 2 (decoupled)";
  }
  if ((amsgrad || nesterov) && kind == kAdamax) {
    return "attributes amsgrad and nesterov must be false for kind 2 (AdaMax)";
  }
  if (state != StateBuffers(amsgrad)) {
    return "attribute state = " + Str(state) + " must be " + Str(StateBuffers(amsgrad)) +
           " (the state buffers of amsgrad = " + (amsgrad ? "true" : "false") + ")";
  }
  return "";
}

// The check of an element offset into state buffers of the given sizes: "" when 0 <= offset
// <= the smallest size.
std::string OffsetError(const char* name, int64_t offset, const int64_t* sizes, int64_t count) {
  int64_t smallest = INT64_MAX;
  for (int64_t k = 0; k < count; ++k) smallest = std::min(smallest, sizes[k]);
  if (count > 0 && (offset < 0 || offset > smallest)) {
    return std::string("attribute ") + name + " = " + Str(offset) + " must be in [0, " +
           Str(smallest) + "] (the smallest state buffer's size)";
  }
  return "";
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
  auto bad = [](const std::string& what) {
    return ffi::Error::InvalidArgument("adamkit cpu step: " + what);
  };
  if (scalars.element_count() != 9) return bad("expected 9 scalars");
  const std::string variant = VariantError(kind, nesterov, decay, amsgrad, state);
  if (!variant.empty()) return bad(variant);
  const size_t nstate = static_cast<size_t>(state);
  if (args.size() < 2 + nstate || (args.size() - nstate) % 2 != 0 ||
      rets.size() != (args.size() - nstate) / 2 + nstate) {
    return bad("expected 2L+S arguments, L+S results (S state buffers)");
  }
  if (offset < 0) return bad("attribute offset = " + Str(offset) + " must be >= 0");
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
      return bad("a moment result differs from its input");
    }
    moments[k] = (*out)->typed_data();
    if (moments[k] != in->typed_data()) std::copy_n(in->typed_data(), moment_size[k], moments[k]);
  }
  const std::string at_error = OffsetError("offset", offset, moment_size, state);
  if (!at_error.empty()) return bad(at_error);
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
      return bad("a gradient differs from its param");
    }
    for (size_t k = 0; k < nstate; ++k) {  // offset + total <= size (checked before)
      if (n > moment_size[k] - offset - total) {
        return bad("a state buffer (" + Str(moment_size[k]) + " elements) is smaller than its " +
                   "params from attribute offset = " + Str(offset));
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

// ---------------------------------------------------------------------------------------
// The dense step on bfloat16 params without a float32 master copy (param_rounding): each
// element computed in float32 as the step above computes it, then written back rounded as
// adamkit/_rounding.py rounds (round_sum): to nearest, stochastically, or Kahan-compensated
// with a bfloat16 buffer. Bit for bit the XLA path's rounding of the same float32 sum.

enum Rounding : int64_t { kNearest = 0, kStochastic = 1, kKahan = 2 };

// bfloat16 is the top half of a float32: widening is exact.
inline float FromBf16(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// float32 -> bfloat16, round to nearest, ties to even (as XLA's convert and
// lax.reduce_precision); NaN stays a quiet NaN of its sign. Branch-free, so loops vectorize.
inline uint16_t ToBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t nearest = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t nan = (bits >> 16) | 0x0040u;
  return static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? nan : nearest);
}

inline float RoundBf16(float x) { return FromBf16(ToBf16(x)); }

inline uint32_t Rotl(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

// Threefry-2x32, 20 rounds: adamkit/_rounding.py's threefry2x32 (JAX's primitive), the
// first output word for key (k0, k1) and counter (c0, c1).
inline uint32_t Threefry2x32(uint32_t k0, uint32_t k1, uint32_t c0, uint32_t c1) {
  static constexpr int kRotations[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
  uint32_t x0 = c0 + ks[0], x1 = c1 + ks[1];
  for (int i = 0; i < 5; ++i) {
    for (int r : kRotations[i % 2]) {
      x0 += x1;
      x1 = Rotl(x1, r) ^ x0;
    }
    x0 += ks[(i + 1) % 3];
    x1 += ks[(i + 2) % 3] + static_cast<uint32_t>(i + 1);
  }
  return x0;
}

// Stochastic rounding of x to bfloat16 with 32 random bits (_rounding._round_with_bits): the
// bfloat16 neighbours of |x| are its bits' top half (lo) and the next (hi), and |x| lies
// (bits & 0xFFFF) / 2^16 of the way from lo to hi; round up when the top 16 random bits are
// below that, so P(up) is that fraction exactly and E[SR(x)] = x, also where the gap is a
// float32 subnormal (which float arithmetic under XLA's flush-to-zero would lose). The same
// decision as u < (|x| - lo) / (hi - lo), u = (bits >> 8) * 2^-24, wherever that quotient is
// exact. NaN and values whose upper neighbour is infinite round to nearest.
inline uint16_t StochasticBf16(float x, uint32_t bits) {
  uint32_t xb;
  std::memcpy(&xb, &x, sizeof xb);
  const uint32_t mag = xb & 0x7FFFFFFFu;
  const uint32_t lo = mag >> 16;
  const uint32_t up = (bits >> 16) < (mag & 0xFFFFu) ? 1u : 0u;
  const uint16_t r = static_cast<uint16_t>(((xb >> 16) & 0x8000u) | (lo + up));
  return (mag > 0x7F800000u || lo == 0x7F7Fu) ? ToBf16(x) : r;
}

// The float32 step of one element, -lr * u (AdamW: -lr * (u + wd * w)): the operations of
// Update above, in its order, with the param's update returned instead of added.
template <int64_t kind, bool nesterov, int64_t decay, bool amsgrad>
inline __attribute__((always_inline)) float StepOf(const Scalars& k, float gi, float w, float& m,
                                                   float& v, float& vmax) {
  if (decay == kL2) gi = gi + k.wd * w;
  float u = 0.0f;
  Update<kind, nesterov, kNoDecay, amsgrad, true>(k, gi, u, m, v, vmax);
  if (decay == kDecoupled) u = u + k.wd * w;
  return -k.lr * u;
}

struct RoundedLeaf {
  uint16_t* p;          // bfloat16
  const void* g;        // bfloat16 or float32 (the call's gradients are all of one dtype)
  float* m;
  float* v;
  float* vmax;          // nullptr without AMSGrad
  uint16_t* comp;       // kahan: the bfloat16 buffer; nullptr otherwise
  uint32_t k0, k1;      // stochastic: this leaf's key of this step
  int64_t n;
  int64_t rest;         // elements per index along axis 0 (the counter's second word)
};

// Element i of one leaf, at counter (c0, c1): the step, then the rounding; the param
// written is what optax.apply_updates writes from ak.param_rounding's update d = new - w
// (w + RN(d), rounded), and the Kahan buffer holds what that dropped of the float32 sum.
template <int64_t kind, bool nesterov, int64_t decay, bool amsgrad, int64_t rounding,
          typename G>
inline __attribute__((always_inline)) void RoundedElement(
    uint16_t* __restrict p, const G* __restrict g, float* __restrict m, float* __restrict v,
    float* __restrict vmax, uint16_t* __restrict comp, uint32_t k0, uint32_t k1,
    const Scalars& k, int64_t i, uint32_t c0, uint32_t c1) {
  float gi;
  if constexpr (std::is_same_v<G, float>) {
    gi = g[i];
  } else {
    gi = FromBf16(g[i]);
  }
  const float w = FromBf16(p[i]);
  float none = 0.0f;
  const float step = StepOf<kind, nesterov, decay, amsgrad>(k, gi, w, m[i], v[i],
                                                            amsgrad ? vmax[i] : none);
  float s, fresh;
  if constexpr (rounding == kKahan) {
    s = w + (step + FromBf16(comp[i]));
    fresh = RoundBf16(s);
  } else if constexpr (rounding == kStochastic) {
    s = w + step;
    fresh = FromBf16(StochasticBf16(s, Threefry2x32(k0, k1, c0, c1)));
  } else {
    s = w + step;
    fresh = RoundBf16(s);
  }
  const float written = RoundBf16(w + RoundBf16(fresh - w));
  p[i] = ToBf16(written);
  if constexpr (rounding == kKahan) comp[i] = ToBf16(s - written);
}

// Elements [lo, hi) of one leaf. Stochastic rounding's counter is (index along axis 0,
// index within the other axes): row by row, so each inner loop has a fixed c0 and
// consecutive c1 (a 1-D leaf: c0 = i, c1 = 0), and vectorizes. The loops run in blocks of
// kRoundedBlock elements, each block prefetching the one kRoundedAhead elements ahead: the
// hardware's stream prefetch alone leaves the loop waiting on memory when the buffers share
// their alignment, as XLA's do (all 64-byte aligned: the nearest step took 1.9x its time).
constexpr int64_t kRoundedBlock = 256;
constexpr int64_t kRoundedAhead = 1024;

template <int64_t kind, bool nesterov, int64_t decay, bool amsgrad, int64_t rounding,
          typename G>
inline __attribute__((always_inline)) void RoundedBody(const RoundedLeaf& l, const Scalars& k,
                                                       int64_t lo, int64_t hi) {
  uint16_t* __restrict p = l.p;
  const G* __restrict g = static_cast<const G*>(l.g);
  float* __restrict m = l.m;
  float* __restrict v = l.v;
  float* __restrict vmax = l.vmax;
  uint16_t* __restrict comp = l.comp;
  const uint32_t k0 = l.k0, k1 = l.k1;
  // Elements [a, b) of row `row` starting at `first` (counters (row, i - first); flat: the
  // non-stochastic steps and 1-D leaves, (i, 0)), after prefetching the cache lines of
  // [a + kRoundedAhead, b + kRoundedAhead) below hi (16 floats or 32 bfloat16s each).
  auto block = [&](auto flat, int64_t a, int64_t b, int64_t row, int64_t first) {
    for (int64_t j = a + kRoundedAhead; j < std::min(hi, b + kRoundedAhead); j += 16) {
      __builtin_prefetch(m + j, 1);
      __builtin_prefetch(v + j, 1);
      if (amsgrad) __builtin_prefetch(vmax + j, 1);
      if (std::is_same_v<G, float>) __builtin_prefetch(g + j, 0);
      if (j % 32 == 0) {
        __builtin_prefetch(p + j, 1);
        if (!std::is_same_v<G, float>) __builtin_prefetch(g + j, 0);
        if (rounding == kKahan) __builtin_prefetch(comp + j, 1);
      }
    }
    for (int64_t i = a; i < b; ++i) {
      RoundedElement<kind, nesterov, decay, amsgrad, rounding, G>(
          p, g, m, v, vmax, comp, k0, k1, k, i,
          static_cast<uint32_t>(decltype(flat)::value ? i : row),
          static_cast<uint32_t>(decltype(flat)::value ? 0 : i - first));
    }
  };
  if (rounding != kStochastic || l.rest == 1) {
    for (int64_t a = lo; a < hi; a += kRoundedBlock) {
      block(std::true_type{}, a, std::min(hi, a + kRoundedBlock), 0, 0);
    }
    return;
  }
  for (int64_t i = lo; i < hi;) {
    const int64_t row = i / l.rest, first = row * l.rest, end = std::min(hi, first + l.rest);
    for (int64_t a = i; a < end; a += kRoundedBlock) {
      block(std::false_type{}, a, std::min(end, a + kRoundedBlock), row, first);
    }
    i = end;
  }
}

// Compiled for the baseline and, on x86-64, for AVX2 and AVX-512 (chosen at run time), as
// Chunk. Same operations, same rounding (no FMA, integer rounding): only the width differs.
template <int64_t kind, bool nesterov, int64_t decay, bool amsgrad, int64_t rounding,
          typename G>
void RoundedChunk(const RoundedLeaf& l, const Scalars& k, int64_t lo, int64_t hi) {
  RoundedBody<kind, nesterov, decay, amsgrad, rounding, G>(l, k, lo, hi);
}

#ifdef ADAMKIT_AVX2
template <int64_t kind, bool nesterov, int64_t decay, bool amsgrad, int64_t rounding,
          typename G>
__attribute__((target("avx2"))) void RoundedChunkAvx2(const RoundedLeaf& l, const Scalars& k,
                                                      int64_t lo, int64_t hi) {
  RoundedBody<kind, nesterov, decay, amsgrad, rounding, G>(l, k, lo, hi);
}

// 512-bit vectors (nearest and stochastic rounding): the rounding's integer work and
// Threefry's rotations (one instruction each at 512 bits) make this loop compute-bound at
// 256 bits.
template <int64_t kind, bool nesterov, int64_t decay, bool amsgrad, int64_t rounding,
          typename G>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512"))) void
RoundedChunkAvx512(const RoundedLeaf& l, const Scalars& k, int64_t lo, int64_t hi) {
  RoundedBody<kind, nesterov, decay, amsgrad, rounding, G>(l, k, lo, hi);
}

bool HasAvx512Rounded() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  }();
  return has;
}
#endif

using RoundedFn = void (*)(const RoundedLeaf&, const Scalars&, int64_t, int64_t);

template <int64_t kind, bool nesterov, int64_t decay, bool amsgrad, int64_t rounding,
          typename G>
RoundedFn RoundedInstance() {
#ifdef ADAMKIT_AVX2
  // Not for Kahan: its 512-bit loop measured 1.9x its 256-bit one on XLA's buffers
  // (72 against 38 CPU ms for 16.8M params, cause not found).
  if constexpr (rounding != kKahan) {
    if (HasAvx512Rounded()) return RoundedChunkAvx512<kind, nesterov, decay, amsgrad, rounding, G>;
  }
  if (HasAvx2()) return RoundedChunkAvx2<kind, nesterov, decay, amsgrad, rounding, G>;
#endif
  return RoundedChunk<kind, nesterov, decay, amsgrad, rounding, G>;
}

template <int64_t kind, bool nesterov, int64_t decay, bool amsgrad, int64_t rounding>
RoundedFn PickGrads(bool g_f32) {
  return g_f32 ? RoundedInstance<kind, nesterov, decay, amsgrad, rounding, float>()
               : RoundedInstance<kind, nesterov, decay, amsgrad, rounding, uint16_t>();
}

template <int64_t kind, bool nesterov, int64_t decay, bool amsgrad>
RoundedFn PickRounding(int64_t rounding, bool g_f32) {
  if (rounding == kStochastic) return PickGrads<kind, nesterov, decay, amsgrad, kStochastic>(g_f32);
  if (rounding == kKahan) return PickGrads<kind, nesterov, decay, amsgrad, kKahan>(g_f32);
  return PickGrads<kind, nesterov, decay, amsgrad, kNearest>(g_f32);
}

// The variant's loop (the handler checks the variant first, as Pick's callers do).
RoundedFn PickRounded(int64_t kind, bool nesterov, int64_t decay, bool amsgrad,
                      int64_t rounding, bool g_f32) {
  auto by_decay = [&](auto K, auto N) -> RoundedFn {
    auto by_amsgrad = [&](auto D) -> RoundedFn {
      constexpr int64_t kk = decltype(K)::value, dd = decltype(D)::value;
      constexpr bool nn = decltype(N)::value;
      if constexpr (kk != kAdamax) {
        if (amsgrad) return PickRounding<kk, nn, dd, true>(rounding, g_f32);
      }
      return PickRounding<kk, nn, dd, false>(rounding, g_f32);
    };
    if (decay == kL2) return by_amsgrad(std::integral_constant<int64_t, kL2>{});
    if (decay == kDecoupled) return by_amsgrad(std::integral_constant<int64_t, kDecoupled>{});
    return by_amsgrad(std::integral_constant<int64_t, kNoDecay>{});
  };
  auto by_nesterov = [&](auto K) -> RoundedFn {
    if constexpr (decltype(K)::value != kAdamax) {
      if (nesterov) return by_decay(K, std::true_type{});
    }
    return by_decay(K, std::false_type{});
  };
  if (kind == kAdamHat) return by_nesterov(std::integral_constant<int64_t, kAdamHat>{});
  if (kind == kAdamCorrected) return by_nesterov(std::integral_constant<int64_t, kAdamCorrected>{});
  return by_nesterov(std::integral_constant<int64_t, kAdamax>{});
}

// Runs `fn` over the global element range [lo, hi) of the concatenated leaves.
void RunRounded(RoundedFn fn, const std::vector<RoundedLeaf>& leaves, const Scalars& k,
                int64_t lo, int64_t hi) {
  int64_t base = 0;
  for (const RoundedLeaf& l : leaves) {
    int64_t a = std::max(lo, base), b = std::min(hi, base + l.n);
    if (a < b) fn(l, k, a - base, b - base);
    base += l.n;
    if (base >= hi) break;
  }
}

// Arguments: scalars (f32[9]), L params (bf16, any shape), L gradients (bf16, or f32 when
// `grads_f32`), the `state` float32 buffers laid out as in Step (from element `offset`),
// then for `rounding` kStochastic the leaves' keys (u32[2L]: k0, k1 per leaf) or for kKahan
// L buffers (bf16, shaped as their params). Results: the L params, the state buffers and
// (kKahan) the L buffers, aliased to the inputs when donated. Every buffer is checked
// against its own size; a param's counters come from its own dimensions.
ffi::Error StepRounded(ffi::ThreadPool pool, ffi::BufferR1<ffi::F32> scalars,
                       ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t kind,
                       bool nesterov, int64_t decay, bool amsgrad, int64_t offset,
                       int64_t state, int64_t rounding, bool grads_f32) {
  auto bad = [](const std::string& what) {
    return ffi::Error::InvalidArgument("adamkit rounded step: " + what);
  };
  if (scalars.element_count() != 9) return bad("expected 9 scalars");
  const std::string variant = VariantError(kind, nesterov, decay, amsgrad, state);
  if (!variant.empty()) return bad(variant);
  if (rounding < kNearest || rounding > kKahan) {
    return bad("attribute rounding = " + Str(rounding) + " must be 0 (nearest), 1 (stochastic) "
               "or 2 (kahan)");
  }
  if (offset < 0) return bad("attribute offset = " + Str(offset) + " must be >= 0");
  const int64_t nstate = state;
  const int64_t nargs = static_cast<int64_t>(args.size());
  const int64_t nrets = static_cast<int64_t>(rets.size());
  // 2L + S (+1 keys | +L buffers) arguments, L + S (+L buffers) results
  int64_t num = -1;
  if (rounding == kKahan) {
    if ((nargs - nstate) % 3 == 0) num = (nargs - nstate) / 3;
  } else if (rounding == kStochastic) {
    if ((nargs - nstate - 1) % 2 == 0) num = (nargs - nstate - 1) / 2;
  } else if ((nargs - nstate) % 2 == 0) {
    num = (nargs - nstate) / 2;
  }
  if (num < 1 || nrets != num + nstate + (rounding == kKahan ? num : 0)) {
    return bad("expected 2L+S arguments (+ keys, or + L Kahan buffers), L+S results (+ L)");
  }
  float* moments[kMaxStateBuffers] = {nullptr, nullptr, nullptr};
  int64_t moment_size[kMaxStateBuffers] = {0, 0, 0};
  for (int64_t j = 0; j < nstate; ++j) {
    auto in = args.get<ffi::Buffer<ffi::F32>>(2 * num + j);
    auto out = rets.get<ffi::Buffer<ffi::F32>>(num + j);
    if (in.has_error()) return in.error();
    if (out.has_error()) return out.error();
    moment_size[j] = static_cast<int64_t>(in->element_count());
    if (static_cast<int64_t>((*out)->element_count()) != moment_size[j]) {
      return bad("a moment result differs from its input");
    }
    moments[j] = (*out)->typed_data();
    if (moments[j] != in->typed_data()) std::copy_n(in->typed_data(), moment_size[j], moments[j]);
  }
  const std::string at_error = OffsetError("offset", offset, moment_size, nstate);
  if (!at_error.empty()) return bad(at_error);
  const uint32_t* keys = nullptr;
  if (rounding == kStochastic) {
    auto k = args.get<ffi::Buffer<ffi::U32>>(2 * num + nstate);
    if (k.has_error()) return k.error();
    if (static_cast<int64_t>(k->element_count()) != 2 * num) return bad("expected 2 key words per param");
    keys = k->typed_data();
  }
  std::vector<RoundedLeaf> leaves(num);
  int64_t total = 0;
  for (int64_t i = 0; i < num; ++i) {
    auto p = args.get<ffi::Buffer<ffi::BF16>>(i);
    auto p_out = rets.get<ffi::Buffer<ffi::BF16>>(i);
    if (p.has_error()) return p.error();
    if (p_out.has_error()) return p_out.error();
    const int64_t n = static_cast<int64_t>(p->element_count());
    const void* g = nullptr;
    int64_t gn = -1;
    if (grads_f32) {
      auto gb = args.get<ffi::Buffer<ffi::F32>>(num + i);
      if (gb.has_error()) return gb.error();
      g = gb->typed_data();
      gn = static_cast<int64_t>(gb->element_count());
    } else {
      auto gb = args.get<ffi::Buffer<ffi::BF16>>(num + i);
      if (gb.has_error()) return gb.error();
      g = gb->typed_data();
      gn = static_cast<int64_t>(gb->element_count());
    }
    if (gn != n || static_cast<int64_t>((*p_out)->element_count()) != n) {
      return bad("a gradient differs from its param");
    }
    for (int64_t j = 0; j < nstate; ++j) {  // offset + total <= size (checked before)
      if (n > moment_size[j] - offset - total) {
        return bad("a state buffer (" + Str(moment_size[j]) + " elements) is smaller than its " +
                   "params from attribute offset = " + Str(offset));
      }
    }
    const auto dims = p->dimensions();
    int64_t rest = 1;
    if (!CountOf(dims, 1, &rest) || (dims.size() > 0 && dims[0] > (int64_t{1} << 32)) ||
        rest > (int64_t{1} << 32)) {
      return bad("a param's counters must fit 32 bits");
    }
    RoundedLeaf& l = leaves[i];
    l.p = reinterpret_cast<uint16_t*>((*p_out)->typed_data());
    const uint16_t* p_in = reinterpret_cast<const uint16_t*>(p->typed_data());
    if (l.p != p_in) std::copy_n(p_in, n, l.p);
    if (rounding == kKahan) {
      auto c = args.get<ffi::Buffer<ffi::BF16>>(2 * num + nstate + i);
      auto c_out = rets.get<ffi::Buffer<ffi::BF16>>(num + nstate + i);
      if (c.has_error()) return c.error();
      if (c_out.has_error()) return c_out.error();
      if (static_cast<int64_t>(c->element_count()) != n ||
          static_cast<int64_t>((*c_out)->element_count()) != n) {
        return bad("a Kahan buffer differs from its param");
      }
      l.comp = reinterpret_cast<uint16_t*>((*c_out)->typed_data());
      const uint16_t* c_in = reinterpret_cast<const uint16_t*>(c->typed_data());
      if (l.comp != c_in) std::copy_n(c_in, n, l.comp);
    } else {
      l.comp = nullptr;
    }
    const int64_t at = offset + total;
    l.g = g;
    l.m = moments[0] + at;
    l.v = moments[1] + at;
    l.vmax = amsgrad ? moments[2] + at : nullptr;
    l.k0 = keys ? keys[2 * i] : 0;
    l.k1 = keys ? keys[2 * i + 1] : 0;
    l.n = n;
    l.rest = std::max<int64_t>(rest, 1);
    total += n;
  }
  RoundedFn fn = PickRounded(kind, nesterov, decay, amsgrad, rounding, grads_f32);
  const Scalars k = LoadScalars(scalars.typed_data());
  constexpr int64_t kMinPerChunk = 1 << 16;  // elements, as the float32 step
  if (total < 2 * kMinPerChunk) {
    RunRounded(fn, leaves, k, 0, total);
    return ffi::Error::Success();
  }
  const int64_t chunk = std::max<int64_t>(kMinPerChunk, (total / (4 * Threads(pool))) &
                                                           ~int64_t{15});
  ParallelFor(pool, total, chunk, [&leaves, fn, &k](int64_t lo, int64_t hi) {
    RunRounded(fn, leaves, k, lo, hi);
  });
  return ffi::Error::Success();
}

// The distinct valid ids (in [0, rows)) of a lazy step's k ids, in first-occurrence order:
// uid[r], the position of its first occurrence first[r], and next[pos] chaining the later
// occurrences of the id at pos (-1: none). Without `merge` each valid occurrence is its
// own row (the caller promised unique ids).
struct DistinctRows {
  std::vector<int32_t> uid, first, next;
};

DistinctRows Distinct(const int32_t* id, int64_t k, int64_t rows, bool merge) {
  DistinctRows d;
  d.next.assign(k, -1);
  d.uid.reserve(k);
  d.first.reserve(k);
  if (!merge) {
    for (int64_t pos = 0; pos < k; ++pos) {
      if (id[pos] >= 0 && id[pos] < rows) {
        d.uid.push_back(id[pos]);
        d.first.push_back(static_cast<int32_t>(pos));
      }
    }
    return d;
  }
  int shift = 32;
  int64_t cap = 1;
  while (cap < 2 * k) cap <<= 1, --shift;
  std::vector<int32_t> slot(cap, -1), last;
  last.reserve(k);
  for (int64_t pos = 0; pos < k; ++pos) {
    const int32_t i = id[pos];
    if (i < 0 || i >= rows) continue;
    uint32_t h = shift < 32 ? (static_cast<uint32_t>(i) * 2654435761u) >> shift : 0;
    while (slot[h] >= 0 && d.uid[slot[h]] != i) h = (h + 1) & (cap - 1);
    if (slot[h] < 0) {
      slot[h] = static_cast<int32_t>(d.uid.size());
      d.uid.push_back(i);
      d.first.push_back(static_cast<int32_t>(pos));
      last.push_back(static_cast<int32_t>(pos));
    } else {
      d.next[last[slot[h]]] = static_cast<int32_t>(pos);
      last[slot[h]] = static_cast<int32_t>(pos);
    }
  }
  return d;
}

// Distinct row r's gradient (width elements): its first occurrence's row of g, or the sum
// of all its occurrences in the order they occur (as a scatter-add sums), in *acc.
const float* MergedRow(const DistinctRows& d, int64_t r, const float* g, int64_t width,
                       std::vector<float>* acc) {
  const float* row = g + static_cast<int64_t>(d.first[r]) * width;
  if (d.next[d.first[r]] < 0) return row;
  acc->assign(row, row + width);
  for (int32_t q = d.next[d.first[r]]; q >= 0; q = d.next[q]) {
    const float* more = g + static_cast<int64_t>(q) * width;
    for (int64_t j = 0; j < width; ++j) (*acc)[j] = (*acc)[j] + more[j];
  }
  return acc->data();
}

// Writes the distinct ids into results `at` (s32[k]; `rows` in unused slots) and zeroes the
// unused rows of the directions, results `at + 1` (f32[k, width]), whose data *u receives.
// An error message, or "" when the results have those sizes.
std::string WriteDistinct(const DistinctRows& d, ffi::RemainingRets& rets, size_t at, int64_t k,
                          int64_t width, int64_t rows, float** u) {
  auto ids_out = rets.get<ffi::Buffer<ffi::S32>>(at);
  auto dir = rets.get<ffi::Buffer<ffi::F32>>(at + 1);
  if (ids_out.has_error() || dir.has_error()) return "the ids and directions results must be s32 and f32";
  if (static_cast<int64_t>((*ids_out)->element_count()) != k ||
      static_cast<int64_t>((*dir)->element_count()) != k * width) {  // k * width fits (checked)
    return "result sizes do not match ids";
  }
  const int64_t distinct = static_cast<int64_t>(d.uid.size());
  int32_t* io = (*ids_out)->typed_data();
  std::copy(d.uid.begin(), d.uid.end(), io);
  std::fill(io + distinct, io + k, static_cast<int32_t>(rows));
  *u = (*dir)->typed_data();
  std::fill(*u + distinct * width, *u + k * width, 0.0f);
  return "";
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
  auto bad = [](const std::string& what) {
    return ffi::Error::InvalidArgument("adamkit sparse step: " + what);
  };
  if (scalars.element_count() != 9) return bad("expected 9 scalars");
  const std::string variant = VariantError(kind, nesterov, decay, amsgrad, state);
  if (!variant.empty()) return bad(variant);
  if (decay == kL2 || (decay == kDecoupled && !apply)) {
    return bad("attribute decay = " + Str(decay) + " must be 0 (none), or 2 (decoupled) with "
               "apply = true");
  }
  const size_t nstate = static_cast<size_t>(state);
  if (args.size() != nstate + (apply ? 1u : 0u) || rets.size() != nstate + (apply ? 1u : 2u)) {
    return bad("wrong number of operands");
  }
  if (rows < 0 || rows > INT32_MAX) {
    return bad("attribute num_rows = " + Str(rows) + " must be in [0, 2^31 - 1]");
  }
  if (offset < 0) return bad("attribute offset = " + Str(offset) + " must be >= 0");
  // Sizes from each buffer's own dimensions: k from the ids, the row width from the
  // gradient rows' shape (not from a division, which a short gradient would fool).
  const int64_t k = static_cast<int64_t>(ids.element_count());
  const auto dims = grad.dimensions();
  int64_t width = 1, rows_size = 0, k_size = 0;  // elements per row, of the table, of k rows
  if (dims.size() < 1 || dims[0] != k || k > INT32_MAX || !CountOf(dims, 1, &width) ||
      __builtin_mul_overflow(width, k, &k_size) ||
      k_size != static_cast<int64_t>(grad.element_count())) {
    return bad("gradient rows do not match ids");
  }
  if (__builtin_mul_overflow(rows, width, &rows_size)) {
    return bad("attribute num_rows = " + Str(rows) + " rows of " + Str(width) +
               " elements overflow int64");
  }
  float* bufs[kMaxStateBuffers + 1] = {nullptr, nullptr, nullptr, nullptr};  // state, table
  for (size_t j = 0; j < args.size(); ++j) {
    auto in = args.get<ffi::Buffer<ffi::F32>>(j);
    auto out = rets.get<ffi::Buffer<ffi::F32>>(j);
    if (in.has_error()) return in.error();
    if (out.has_error()) return out.error();
    const int64_t n = static_cast<int64_t>(in->element_count());
    if (static_cast<int64_t>((*out)->element_count()) != n) {
      return bad("a result differs from its input");
    }
    if (j < nstate && !Fits(offset, rows_size, n)) {
      static const char* const kNames[] = {"first moment", "second moment", "running maximum"};
      return bad(std::string("the ") + kNames[j] + " (" + Str(n) + " elements) does not hold " +
                 "attribute num_rows = " + Str(rows) + " rows of " + Str(width) +
                 " elements from attribute offset = " + Str(offset) + " (offset must be in [0, " +
                 Str(n) + " - num_rows * width])");
    }
    if (j == nstate && n != rows_size) {
      return bad("the table (" + Str(n) + " elements) is not attribute num_rows = " + Str(rows) +
                 " rows of the gradient's width " + Str(width));
    }
    bufs[j] = (*out)->typed_data();
    if (bufs[j] != in->typed_data()) std::copy_n(in->typed_data(), n, bufs[j]);
  }
  const DistinctRows d = Distinct(ids.typed_data(), k, rows, merge);
  const float* g = grad.typed_data();
  const int64_t distinct = static_cast<int64_t>(d.uid.size());
  float* u_out = nullptr;
  if (!apply) {
    const std::string error = WriteDistinct(d, rets, nstate, k, width, rows, &u_out);
    if (!error.empty()) return bad(error);
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
        const int64_t at = static_cast<int64_t>(d.uid[r + kAhead]) * width;
        for (int64_t c = 0; c < lines; ++c) {
          __builtin_prefetch(m + at + 16 * c, 1);
          __builtin_prefetch(v + at + 16 * c, 1);
          if (amsgrad) __builtin_prefetch(vmax + at + 16 * c, 1);
          if (apply) __builtin_prefetch(p + at + 16 * c, 1);
        }
      }
      const float* row = MergedRow(d, r, g, width, &acc);
      const int64_t at = static_cast<int64_t>(d.uid[r]) * width;
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
  }
  if (!CountOf(tdims, 1, &width)) {
    return ffi::Error::InvalidArgument("adamkit row add: the table's row size overflows int64");
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

// ------------------------------------------------------------- 8-bit quantized moments
//
// AdamkitCpuStepQuantized: the dense step with some state buffers stored in adamkit's
// "8bit" format (adamkit/_quant.py): uint8 codes and one float32 scale per block of B
// consecutive elements, value = book[code] * scale. Per block, in one pass over memory:
// decode the block's moments into float32 scratch, run the float32 step's own loop
// (ChunkBody) on it, then encode: non-finite values are stored as 0 (and the second
// moments, buffers 1 and 2, clamped at 0), scale = max(max |x|, 1e-12), and each code is
// the nearest entry of the code book, ties up: the number of midpoints <= x * (1 / scale)
// (XLA rewrites _quant's x / scale into that product; the codes are bit for bit _quant's
// under jit). The code books and midpoints come from Python (_quant.code_book), so there
// is one definition of the format.

constexpr int64_t kBook = 256;          // codes per book
constexpr int64_t kMaxBlock = 1 << 20;  // elements per block (bounds the scratch)
constexpr float kScaleFloor = 1e-12f;   // _quant.SCALE_FLOOR

// The nearest-code search. A float r is mapped to an order-preserving int32 key t (its bits,
// the magnitude bits flipped for a negative float, so that t orders as r does); the top 16
// bits of t (sign, exponent, 7 mantissa bits) name a bucket k, and a table gives per bucket
// the number of midpoints below it and the one midpoint inside it, if any (no bucket of the
// 8-bit formats' maps holds two). Entry = count << 16, plus 2^16 minus the midpoint's low 16
// bits of t (nothing without a midpoint), minus k << 16, all mod 2^32, so that
// code = (entry + t) >> 16: t is k << 16 plus its low bits, and their sum with the
// midpoint's complement carries into the count exactly when r is at or above the midpoint
// (the sum is below 2^24: the code is its byte 2). The table has a bucket for every key
// (256 KiB, of which a step touches the buckets of the values it meets), so no index needs
// a bound check. A code book whose midpoints break these rules (two in a bucket, a midpoint
// at 0, whose two keys -0.0 and +0.0 the table would tell apart) falls back to a binary
// search, and the step to its general path.
class CodeSearch {
 public:
  // False when the midpoints are not finite and sorted.
  bool Init(const float* mid) {
    for (int64_t i = 0; i < kBook - 1; ++i) {
      if (!std::isfinite(mid[i]) || (i > 0 && mid[i] < mid[i - 1])) return false;
      mid_[i] = mid[i];
    }
    mid_[kBook - 1] = INFINITY;  // never <= a finite r
    int32_t keys[kBook - 1];
    table_ok_ = true;
    for (int64_t i = 0; i < kBook - 1; ++i) {
      keys[i] = Key(mid_[i]);
      table_ok_ = table_ok_ && mid_[i] != 0.0f;
    }
    table_.assign(kBuckets, 0);
    int64_t below = 0;  // midpoints under bucket k
    for (int64_t k = 0; k < kBuckets; ++k) {
      const int64_t lo = (k - kBuckets / 2) * (kLow + 1);
      while (below < kBook - 1 && keys[below] < lo) ++below;
      int64_t upto = below;  // midpoints up to the bucket's top
      while (upto < kBook - 1 && keys[upto] <= lo + kLow) ++upto;
      uint32_t entry = static_cast<uint32_t>(below - (k - kBuckets / 2)) << kShift;
      if (upto > below) {
        table_ok_ = table_ok_ && upto - below == 1;
        entry += static_cast<uint32_t>((kLow + 1) - (keys[below] & kLow));
      }
      table_[k] = entry;
    }
    return true;
  }

  // Whether the table holds (else Code() searches).
  bool fast() const { return table_ok_; }

  uint8_t Code(float r) const {
    if (!table_ok_) {
      return static_cast<uint8_t>(std::upper_bound(mid_, mid_ + kBook - 1, r) - mid_);
    }
    const int32_t t = Key(r);
    return static_cast<uint8_t>((table_[(t >> kShift) + kBuckets / 2] + static_cast<uint32_t>(t)) >>
                                kShift);
  }

#ifdef ADAMKIT_AVX2
  // Code() of each lane of r, as int32 lanes (needs fast()). nonneg: r >= +0 in every lane.
  template <bool nonneg>
  __attribute__((target("avx2"), always_inline)) inline __m256i Codes8(__m256 r) const {
    __m256i t = _mm256_castps_si256(r);
    if (!nonneg) t = _mm256_xor_si256(t, _mm256_srli_epi32(_mm256_srai_epi32(t, 31), 1));
    const __m256i entry = _mm256_i32gather_epi32(reinterpret_cast<const int*>(table_.data()) + kBuckets / 2,
                                                 _mm256_srai_epi32(t, kShift), 4);
    return _mm256_srli_epi32(_mm256_add_epi32(entry, t), kShift);
  }

  // Code() of x[i] * inv for i < n (a multiple of 8), eight at a time (needs fast()).
  __attribute__((target("avx2"))) void CodesAvx2(const float* x, float inv, int64_t n,
                                                 uint8_t* out) const {
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int64_t i = 0; i < n; i += 8) {
      const __m256i code = Codes8<false>(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv));
      const __m128i c16 = _mm_packus_epi32(_mm256_castsi256_si128(code),
                                           _mm256_extracti128_si256(code, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), _mm_packus_epi16(c16, c16));
    }
  }

  // Codes8 on sixteen lanes, each in byte 2 of its lane (the other bytes are not zero), by
  // the table at `base` (Base()): a static function, so that a loop holds the pointer in a
  // register instead of reloading it through the search before every gather (a store to a
  // float buffer might, for all the compiler knows, have moved the vector's data).
  template <bool nonneg>
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vbmi"), always_inline)) static inline
  __m512i Codes16At(const uint32_t* base, __m512 r) {
    __m512i t = _mm512_castps_si512(r);
    if (!nonneg) t = _mm512_mask_xor_epi32(t, _mm512_movepi32_mask(t), t, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512i entry = _mm512_i32gather_epi32(_mm512_srai_epi32(t, kShift), base, 4);
    return _mm512_add_epi32(entry, t);
  }

  // The table's middle bucket (key 0), what Codes16At() indexes from.
  const uint32_t* Base() const { return table_.data() + kBuckets / 2; }
#endif

 private:
  static constexpr int32_t kShift = 16;  // the low bits of t below a bucket
  static constexpr int32_t kLow = (1 << kShift) - 1;
  static constexpr int64_t kBuckets = int64_t{1} << (32 - kShift);

  // The order-preserving key of a float that is not NaN (-0.0 is -1, +0.0 is 0).
  static int32_t Key(float r) {
    int32_t bits;
    std::memcpy(&bits, &r, 4);
    return bits ^ static_cast<int32_t>(static_cast<uint32_t>(bits >> 31) >> 1);
  }

  float mid_[kBook];  // the 255 midpoints, then +inf (the binary search's)
  std::vector<uint32_t> table_;
  bool table_ok_ = false;
};

// One search per distinct set of midpoints (the formats' books are few), built once;
// nullptr when the midpoints are not finite and sorted.
std::shared_ptr<const CodeSearch> SearchFor(const float* mid) {
  struct Entry {
    std::vector<float> mid;
    std::shared_ptr<const CodeSearch> search;
  };
  static std::mutex mu;
  static std::vector<Entry> cache;
  std::lock_guard<std::mutex> lock(mu);
  for (const Entry& c : cache) {
    if (std::equal(c.mid.begin(), c.mid.end(), mid)) return c.search;
  }
  auto search = std::make_shared<CodeSearch>();
  if (!search->Init(mid)) return nullptr;
  if (cache.size() >= 16) cache.erase(cache.begin());  // bounded (a caller keeps its own)
  cache.push_back(Entry{std::vector<float>(mid, mid + kBook - 1), search});
  return search;
}

// One state buffer of the quantized step: float32 moments, or codes + scales.
struct QBuffer {
  bool quantized = false;
  bool nonneg = false;  // a second moment (or its running maximum): stored clamped at 0
  float* f = nullptr;   // float32: the moments
  uint8_t* codes = nullptr;
  float* scales = nullptr;
  const float* book = nullptr;
  std::shared_ptr<const CodeSearch> search;
};

struct QLeaf {
  float* p;
  const float* g;
  int64_t n;
  int64_t at[kMaxStateBuffers];  // float32 buffers: element offset; quantized: block offset
};

// Decodes c values of block `blk` of buffer b into x.
inline void DecodeBlock(const QBuffer& b, int64_t block, int64_t blk, int64_t c, float* x) {
  const uint8_t* code = b.codes + blk * block;
  const float scale = b.scales[blk];
  for (int64_t i = 0; i < c; ++i) x[i] = b.book[code[i]] * scale;
}

// The values of x as _quant.encode_blocks stores them (non-finite: 0; a second moment:
// clamped at 0), and their largest magnitude.
inline float Sanitize(bool nonneg, int64_t c, float* x) {
  float amax = 0.0f;
  for (int64_t i = 0; i < c; ++i) {
    float xi = std::isfinite(x[i]) ? x[i] : 0.0f;
    if (nonneg) xi = std::max(xi, 0.0f);
    x[i] = xi;
    amax = std::max(amax, std::fabs(xi));
  }
  return amax;
}

#ifdef ADAMKIT_AVX2
__attribute__((target("avx2"))) void DecodeAvx2(const uint8_t* code, const float* book,
                                                float scale, int64_t c, float* x) {
  const __m256 vs = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= c; i += 8) {
    const __m256i k = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(code + i)));
    _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_i32gather_ps(book, k, 4), vs));
  }
  for (; i < c; ++i) x[i] = book[code[i]] * scale;
}

__attribute__((target("avx2"))) float SanitizeAvx2(bool nonneg, int64_t c, float* x) {
  const __m256i exp = _mm256_set1_epi32(0x7F800000);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 amax = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= c; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i inf_or_nan = _mm256_cmpeq_epi32(_mm256_and_si256(bits, exp), exp);
    v = _mm256_andnot_ps(_mm256_castsi256_ps(inf_or_nan), v);
    if (nonneg) v = _mm256_max_ps(v, _mm256_setzero_ps());
    _mm256_storeu_ps(x + i, v);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v, magnitude));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  float m = *std::max_element(lanes, lanes + 8);
  return std::max(m, Sanitize(nonneg, c - i, x + i));
}
#endif

// Stores the c sanitized values of x, whose largest magnitude is amax, as block `blk` of
// buffer b (the rest of the block is padding, stored as 0), as _quant.encode_blocks does.
void StoreCodes(const QBuffer& b, int64_t block, int64_t blk, int64_t c, float* x, float amax) {
  uint8_t* code = b.codes + blk * block;
  const float scale = std::max(amax, kScaleFloor);
  std::fill(x + c, x + block, 0.0f);
#ifdef ADAMKIT_AVX2
  if (HasAvx2() && b.search->fast() && block >= 8) {
    b.search->CodesAvx2(x, 1.0f / scale, block, code);
    b.scales[blk] = scale;
    return;
  }
#endif
  const float inv = 1.0f / scale;
  for (int64_t i = 0; i < block; ++i) code[i] = b.search->Code(x[i] * inv);
  b.scales[blk] = scale;
}

// Encodes the c values of x into block `blk` of buffer b.
void EncodeBlock(const QBuffer& b, int64_t block, int64_t blk, int64_t c, float* x) {
#ifdef ADAMKIT_AVX2
  if (HasAvx2()) return StoreCodes(b, block, blk, c, x, SanitizeAvx2(b.nonneg, c, x));
#endif
  StoreCodes(b, block, blk, c, x, Sanitize(b.nonneg, c, x));
}

void Decode(const QBuffer& b, int64_t block, int64_t blk, int64_t c, float* x) {
#ifdef ADAMKIT_AVX2
  if (HasAvx2()) return DecodeAvx2(b.codes + blk * block, b.book, b.scales[blk], c, x);
#endif
  DecodeBlock(b, block, blk, c, x);
}

// The AVX2 pass over a leaf's whole blocks when every state buffer is 8-bit and the step
// has no AMSGrad (the other cases take RunBlocks' general path, which this mirrors bit for
// bit). Block by block, in one loop over groups of eight elements: decode m and v (a gather
// from the code book each), the step (QStep8: Update's operations in the same order, no
// FMA), sanitize, store the new moments in a stack buffer and keep the block's largest
// magnitudes; then the block's scales. The codes of block j are encoded in the same loop
// as the step of block j + 1, so that the encode's integer work and gathers fill the time
// the divider spends on the step's sqrt and division.
#ifdef ADAMKIT_AVX2
constexpr int64_t kFastMaxBlock = 1024;  // the stack buffers' block size bound
constexpr int64_t kPrefetch = 512;       // elements ahead (prefetching past a buffer is harmless)

// The scalars of Scalars, broadcast (lr negated once, as Update's -k.lr).
struct Scalars8 {
  __m256 b1, omb1, b2, omb2, eps, neg_lr, wd, c1, c2;
};

template <int64_t kind, bool nesterov, int64_t decay>
__attribute__((target("avx2"), always_inline)) inline void QStep8(const Scalars8& k, __m256 g,
                                                                  __m256& p, __m256& m,
                                                                  __m256& v) {
  if (decay == kL2) g = _mm256_add_ps(g, _mm256_mul_ps(k.wd, p));
  const __m256 mi = _mm256_add_ps(_mm256_mul_ps(k.b1, m), _mm256_mul_ps(k.omb1, g));
  __m256 vi, u;
  if (kind == kAdamax) {
    // max(b2 v, |g|) with a NaN of either side kept, as Step's scalar rule: |g| where it is
    // NaN or larger, else b2 v (NaN included)
    const __m256 abs_g = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g);
    const __m256 decayed = _mm256_mul_ps(k.b2, v);
    const __m256 take_g = _mm256_or_ps(_mm256_cmp_ps(abs_g, decayed, _CMP_GT_OQ),
                                       _mm256_cmp_ps(abs_g, abs_g, _CMP_UNORD_Q));
    vi = _mm256_blendv_ps(decayed, abs_g, take_g);
    u = _mm256_div_ps(mi, _mm256_mul_ps(k.c1, _mm256_add_ps(vi, k.eps)));
  } else {
    vi = _mm256_add_ps(_mm256_mul_ps(k.b2, v), _mm256_mul_ps(k.omb2, _mm256_mul_ps(g, g)));
    const __m256 n =
        nesterov ? _mm256_add_ps(_mm256_mul_ps(k.b1, mi), _mm256_mul_ps(k.omb1, g)) : mi;
    if (kind == kAdamHat) {
      u = _mm256_div_ps(_mm256_mul_ps(k.c1, n), _mm256_add_ps(_mm256_sqrt_ps(vi), k.eps));
    } else {
      u = _mm256_div_ps(_mm256_mul_ps(n, k.c1),
                        _mm256_add_ps(_mm256_sqrt_ps(_mm256_mul_ps(vi, k.c2)), k.eps));
    }
  }
  m = mi;
  v = vi;
  if (decay == kDecoupled) u = _mm256_add_ps(u, _mm256_mul_ps(k.wd, p));
  p = _mm256_add_ps(p, _mm256_mul_ps(k.neg_lr, u));
}

// Sanitize() on eight values: non-finite to 0, and (nonneg) negative to 0.
template <bool nonneg>
__attribute__((target("avx2"), always_inline)) inline __m256 QSanitize8(__m256 x) {
  const __m256i exp = _mm256_set1_epi32(0x7F800000);
  const __m256i bits = _mm256_castps_si256(x);
  x = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(bits, exp), exp)), x);
  return nonneg ? _mm256_max_ps(x, _mm256_setzero_ps()) : x;
}

__attribute__((target("avx2"), always_inline)) inline __m256 QDecode8(const uint8_t* code,
                                                                      const float* book,
                                                                      __m256 scale) {
  const __m256i k = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(code)));
  return _mm256_mul_ps(_mm256_i32gather_ps(book, k, 4), scale);
}

template <bool nonneg>
__attribute__((target("avx2"), always_inline)) inline void QEncode8(const CodeSearch& search,
                                                                    const float* x, __m256 inv,
                                                                    uint8_t* out) {
  const __m256i code = search.Codes8<nonneg>(_mm256_mul_ps(_mm256_load_ps(x), inv));
  const __m128i c16 = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(c16, c16));
}

__attribute__((target("avx2"))) inline float QMax8(__m256 x) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, x);
  return *std::max_element(lanes, lanes + 8);
}

// Blocks [j0, j1) of leaf l, all whole, with bufs[0] (m) and bufs[1] (v) quantized.
template <int64_t kind, bool nesterov, int64_t decay, bool encode_prev>
__attribute__((target("avx2"), always_inline)) inline void QBlockAvx2(
    const Scalars8& k, const QBuffer* bufs, int64_t block, float* p, const float* g,
    int64_t blk_m, int64_t blk_v, float* xm, float* xv, const float* prev_m,
    const float* prev_v, __m256 inv_m, __m256 inv_v, uint8_t* prev_code_m,
    uint8_t* prev_code_v) {
  const uint8_t* code_m = bufs[0].codes + blk_m * block;
  const uint8_t* code_v = bufs[1].codes + blk_v * block;
  const __m256 scale_m = _mm256_set1_ps(bufs[0].scales[blk_m]);
  const __m256 scale_v = _mm256_set1_ps(bufs[1].scales[blk_v]);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 amax_m = _mm256_setzero_ps(), amax_v = _mm256_setzero_ps();
  for (int64_t i = 0; i < block; i += 8) {
    __m256 m = QDecode8(code_m + i, bufs[0].book, scale_m);
    __m256 v = QDecode8(code_v + i, bufs[1].book, scale_v);
    // The previous block's codes before this step, not after it (as in QBlockAvx512; a C++
    // harness, 16.8M parameters from memory on two threads: 20-40% less time, 3% in cache).
    if (encode_prev) {
      QEncode8<false>(*bufs[0].search, prev_m + i, inv_m, prev_code_m + i);
      QEncode8<true>(*bufs[1].search, prev_v + i, inv_v, prev_code_v + i);
    }
    __m256 pi = _mm256_loadu_ps(p + i);
    QStep8<kind, nesterov, decay>(k, _mm256_loadu_ps(g + i), pi, m, v);
    _mm256_storeu_ps(p + i, pi);
    m = QSanitize8<false>(m);
    v = QSanitize8<true>(v);
    _mm256_store_ps(xm + i, m);
    _mm256_store_ps(xv + i, v);
    amax_m = _mm256_max_ps(amax_m, _mm256_and_ps(m, magnitude));
    amax_v = _mm256_max_ps(amax_v, _mm256_and_ps(v, magnitude));
  }
  bufs[0].scales[blk_m] = std::max(QMax8(amax_m), kScaleFloor);
  bufs[1].scales[blk_v] = std::max(QMax8(amax_v), kScaleFloor);
}

template <int64_t kind, bool nesterov, int64_t decay>
__attribute__((target("avx2"))) void QuantBlocksAvx2(const QLeaf& l, const QBuffer* bufs,
                                                     int64_t block, const float* s, int64_t j0,
                                                     int64_t j1) {
  const Scalars sc = LoadScalars(s);
  const Scalars8 k{_mm256_set1_ps(sc.b1),   _mm256_set1_ps(sc.omb1), _mm256_set1_ps(sc.b2),
                   _mm256_set1_ps(sc.omb2), _mm256_set1_ps(sc.eps),  _mm256_set1_ps(-sc.lr),
                   _mm256_set1_ps(sc.wd),   _mm256_set1_ps(sc.c1),   _mm256_set1_ps(sc.c2)};
  alignas(32) float x[2][2][kFastMaxBlock];  // [block parity][m, v]
  const __m256 none = _mm256_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    float* xm = x[j & 1][0];
    float* xv = x[j & 1][1];
    float* p = l.p + j * block;
    const float* g = l.g + j * block;
    const int64_t bm = l.at[0] + j, bv = l.at[1] + j;
    if (j == j0) {
      QBlockAvx2<kind, nesterov, decay, false>(k, bufs, block, p, g, bm, bv, xm, xv, nullptr,
                                               nullptr, none, none, nullptr, nullptr);
    } else {
      QBlockAvx2<kind, nesterov, decay, true>(
          k, bufs, block, p, g, bm, bv, xm, xv, x[(j - 1) & 1][0], x[(j - 1) & 1][1],
          _mm256_set1_ps(1.0f / bufs[0].scales[bm - 1]), _mm256_set1_ps(1.0f / bufs[1].scales[bv - 1]),
          bufs[0].codes + (bm - 1) * block, bufs[1].codes + (bv - 1) * block);
    }
  }
  if (j1 > j0) {  // the last block's codes
    const int64_t j = j1 - 1, bm = l.at[0] + j, bv = l.at[1] + j;
    const __m256 inv_m = _mm256_set1_ps(1.0f / bufs[0].scales[bm]);
    const __m256 inv_v = _mm256_set1_ps(1.0f / bufs[1].scales[bv]);
    for (int64_t i = 0; i < block; i += 8) {
      QEncode8<false>(*bufs[0].search, x[j & 1][0] + i, inv_m, bufs[0].codes + bm * block + i);
      QEncode8<true>(*bufs[1].search, x[j & 1][1] + i, inv_v, bufs[1].codes + bv * block + i);
    }
  }
}

// The same pass in AVX-512 (with VBMI's byte permutes), for blocks of 64 or more: 64
// elements per iteration, and no gather to decode. The code book's 256 floats are held as
// four planes of 256 bytes (byte k of each float), each plane sixteen zmm registers' worth;
// a byte of every one of 64 codes is two two-table permutes, merge-masked on the code's
// top bit, and the four planes interleave back into floats. Interleaving works within 128-bit
// lanes, so the codes enter in the order LaneOrder() (element 16q + 4l + j at 16l + 4q + j).
#define ADAMKIT_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vbmi")))

bool HasAvx512Vbmi() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vbmi");
  }();
  return has;
}

struct Scalars16 {
  __m512 b1, omb1, b2, omb2, eps, neg_lr, wd, c1, c2;
};

// QStep8 on sixteen lanes.
template <int64_t kind, bool nesterov, int64_t decay>
ADAMKIT_AVX512 __attribute__((always_inline)) inline void QStep16(const Scalars16& k, __m512 g,
                                                                  __m512& p, __m512& m,
                                                                  __m512& v) {
  if (decay == kL2) g = _mm512_add_ps(g, _mm512_mul_ps(k.wd, p));
  const __m512 mi = _mm512_add_ps(_mm512_mul_ps(k.b1, m), _mm512_mul_ps(k.omb1, g));
  __m512 vi, u;
  if (kind == kAdamax) {
    // max(b2 v, |g|) with a NaN of either side kept (Step's scalar rule)
    const __m512 abs_g = _mm512_andnot_ps(_mm512_set1_ps(-0.0f), g);
    const __m512 decayed = _mm512_mul_ps(k.b2, v);
    const __mmask16 take_g = _mm512_cmp_ps_mask(abs_g, decayed, _CMP_GT_OQ) |
                             _mm512_cmp_ps_mask(abs_g, abs_g, _CMP_UNORD_Q);
    vi = _mm512_mask_blend_ps(take_g, decayed, abs_g);
    u = _mm512_div_ps(mi, _mm512_mul_ps(k.c1, _mm512_add_ps(vi, k.eps)));
  } else {
    vi = _mm512_add_ps(_mm512_mul_ps(k.b2, v), _mm512_mul_ps(k.omb2, _mm512_mul_ps(g, g)));
    const __m512 n =
        nesterov ? _mm512_add_ps(_mm512_mul_ps(k.b1, mi), _mm512_mul_ps(k.omb1, g)) : mi;
    if (kind == kAdamHat) {
      u = _mm512_div_ps(_mm512_mul_ps(k.c1, n), _mm512_add_ps(_mm512_sqrt_ps(vi), k.eps));
    } else {
      u = _mm512_div_ps(_mm512_mul_ps(n, k.c1),
                        _mm512_add_ps(_mm512_sqrt_ps(_mm512_mul_ps(vi, k.c2)), k.eps));
    }
  }
  m = mi;
  v = vi;
  if (decay == kDecoupled) u = _mm512_add_ps(u, _mm512_mul_ps(k.wd, p));
  p = _mm512_add_ps(p, _mm512_mul_ps(k.neg_lr, u));
}

// A code book as four byte planes, 4 x 4 zmm.
struct BookPlanes {
  __m512i t[4][4];
};

ADAMKIT_AVX512 inline void LoadPlanes(const float* book, BookPlanes* out) {
  alignas(64) uint8_t planes[4][kBook];
  for (int64_t c = 0; c < kBook; ++c) {
    uint32_t bits;
    std::memcpy(&bits, &book[c], 4);
    for (int64_t b = 0; b < 4; ++b) planes[b][c] = static_cast<uint8_t>(bits >> (8 * b));
  }
  for (int64_t b = 0; b < 4; ++b) {
    for (int64_t q = 0; q < 4; ++q) out->t[b][q] = _mm512_load_si512(planes[b] + 64 * q);
  }
}

ADAMKIT_AVX512 inline __m512i LaneOrder() {
  alignas(64) uint8_t idx[64];
  for (int l = 0; l < 4; ++l) {
    for (int q = 0; q < 4; ++q) {
      for (int j = 0; j < 4; ++j) idx[16 * l + 4 * q + j] = static_cast<uint8_t>(16 * q + 4 * l + j);
    }
  }
  return _mm512_load_si512(idx);
}

// book[code[i]] * scale for 64 codes, as x[q] = elements 16q .. 16q + 15. A plane's byte
// is two merge-masked permutes, no blend: the first writes the codes of 128 and up (their
// low seven bits index planes t[k][2..3]) and keeps the others, which the second, indexed
// by what the first left, looks up in t[k][0..1] (one instruction less per plane than two
// permutes and a blend: measured, 2-3% of the fused step).
ADAMKIT_AVX512 __attribute__((always_inline)) inline void QDecode64(const BookPlanes& bp,
                                                                    __m512i order,
                                                                    const uint8_t* code,
                                                                    __m512 scale, __m512 x[4]) {
  const __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(code));
  const __mmask64 top = _mm512_movepi8_mask(c);
  const __mmask64 low = _knot_mask64(top);
  __m512i b[4];
  for (int k = 0; k < 4; ++k) {
    const __m512i high = _mm512_mask2_permutex2var_epi8(bp.t[k][2], c, top, bp.t[k][3]);
    b[k] = _mm512_mask2_permutex2var_epi8(bp.t[k][0], high, low, bp.t[k][1]);
  }
  const __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
  const __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
  x[0] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23)), scale);
  x[1] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23)), scale);
  x[2] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23)), scale);
  x[3] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23)), scale);
}

// CodeSearch::Codes16At of x[0 .. 16) * inv, by the table at `base` (CodeSearch::Base()).
template <bool nonneg>
ADAMKIT_AVX512 __attribute__((always_inline)) inline __m512i QCodes16(const uint32_t* base,
                                                                     const float* x, __m512 inv) {
  return CodeSearch::Codes16At<nonneg>(base, _mm512_mul_ps(_mm512_load_ps(x), inv));
}

// Stores the 64 codes of c[q] (elements 16q .. 16q + 15, QCodes16's lanes) at out: byte 2
// of each lane, picked by two-table byte permutes (pick: byte 4i + 2 of the pair to byte i,
// and again from 32 on).
ADAMKIT_AVX512 __attribute__((always_inline)) inline void QStoreCodes64(__m512i pick,
                                                                        const __m512i c[4],
                                                                        uint8_t* out) {
  const __m512i lo = _mm512_permutex2var_epi8(c[0], pick, c[1]);
  const __m512i hi = _mm512_permutex2var_epi8(c[2], pick, c[3]);
  _mm512_storeu_si512(out, _mm512_mask_blend_epi8(0xFFFFFFFF00000000ull, lo, hi));
}

// The codes of x[0 .. 64) * inv, stored at out.
template <bool nonneg>
ADAMKIT_AVX512 __attribute__((always_inline)) inline void QEncode64(const CodeSearch& search,
                                                                    __m512i pick, const float* x,
                                                                    __m512 inv, uint8_t* out) {
  __m512i c[4];
  for (int q = 0; q < 4; ++q) c[q] = QCodes16<nonneg>(search.Base(), x + 16 * q, inv);
  QStoreCodes64(pick, c, out);
}

ADAMKIT_AVX512 inline __m512i TopBytes() {
  alignas(64) uint8_t idx[64];
  for (int i = 0; i < 64; ++i) idx[i] = static_cast<uint8_t>(4 * (i % 32) + 2);
  return _mm512_load_si512(idx);
}

template <int64_t kind, bool nesterov, int64_t decay, bool encode_prev>
ADAMKIT_AVX512 __attribute__((always_inline)) inline void QBlockAvx512(
    const Scalars16& k, const QBuffer* bufs, const BookPlanes& book_m, const BookPlanes& book_v,
    __m512i order, __m512i pick, int64_t block, float* p, const float* g, int64_t blk_m,
    int64_t blk_v,
    float* xm, float* xv, const float* prev_m, const float* prev_v, __m512 inv_m, __m512 inv_v,
    uint8_t* prev_code_m, uint8_t* prev_code_v) {
  // Sanitize() changes nothing unless some new m or v is not finite or some v is negative.
  // What tells that, at one instruction per sixteen values of each moment: v's largest bit
  // pattern as an unsigned integer (it orders finite v >= +0 as floats do, and puts +inf,
  // NaN and anything with a sign bit above them), m's largest magnitude (vrangeps: it keeps
  // an inf but drops a NaN) and m's old scale. A NaN of m then shows in v: in Adam, g * g
  // enters v, so a finite v means a finite g, and with a finite old m (a finite scale, code
  // book values within [-1, 1]) and |1 - b1| <= 1 (PickQuant's conditions), the new m is
  // finite or +-inf. AdaMax's v = max(|g|, b2 v) drops a NaN g: there, the sum of m tells.
  constexpr bool sum = kind == kAdamax;
  const uint8_t* code_m = bufs[0].codes + blk_m * block;
  const uint8_t* code_v = bufs[1].codes + blk_v * block;
  const uint32_t* table_m = bufs[0].search->Base();
  const uint32_t* table_v = bufs[1].search->Base();
  const bool finite_scale = std::isfinite(bufs[0].scales[blk_m]);
  const __m512 scale_m = _mm512_set1_ps(bufs[0].scales[blk_m]);
  const __m512 scale_v = _mm512_set1_ps(bufs[1].scales[blk_v]);
  __m512 amax_m = _mm512_setzero_ps(), sum_m = _mm512_setzero_ps();
  __m512i top_v = _mm512_setzero_si512();
  for (int64_t i = 0; i < block; i += 64) {
    // The hardware's stream prefetch alone leaves the loop waiting on memory.
    for (int q = 0; q < 4; ++q) {
      _mm_prefetch(reinterpret_cast<const char*>(p + i + kPrefetch + 16 * q), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(g + i + kPrefetch + 16 * q), _MM_HINT_T0);
    }
    _mm_prefetch(reinterpret_cast<const char*>(code_m + i + kPrefetch), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(code_v + i + kPrefetch), _MM_HINT_T0);
    __m512 m[4], v[4];
    QDecode64(book_m, order, code_m + i, scale_m, m);
    QDecode64(book_v, order, code_v + i, scale_v, v);
    // The previous block's codes are looked up sixteen at a time, each before a step, not
    // all 64 after the steps: the table gathers (load ports) then overlap the steps'
    // arithmetic and divisions. Measured (a C++ harness, 16.8M parameters): 8% less time in
    // cache on one thread, 6% from memory on two; all 64 before the steps, 5% more; in a
    // loop of their own before or after this one, 9-14% more.
    __m512i cm[4], cv[4];
    for (int q = 0; q < 4; ++q) {
      if (encode_prev) {
        cm[q] = QCodes16<false>(table_m, prev_m + i + 16 * q, inv_m);
        cv[q] = QCodes16<true>(table_v, prev_v + i + 16 * q, inv_v);
      }
      __m512 pq = _mm512_loadu_ps(p + i + 16 * q);
      QStep16<kind, nesterov, decay>(k, _mm512_loadu_ps(g + i + 16 * q), pq, m[q], v[q]);
      _mm512_storeu_ps(p + i + 16 * q, pq);
      _mm512_store_ps(xm + i + 16 * q, m[q]);
      _mm512_store_ps(xv + i + 16 * q, v[q]);
      amax_m = _mm512_range_ps(amax_m, m[q], 0x0B);  // 0x0B: the larger magnitude, sign cleared
      top_v = _mm512_max_epu32(top_v, _mm512_castps_si512(v[q]));
      if (sum) sum_m = _mm512_add_ps(sum_m, m[q]);
    }
    if (encode_prev) {
      QStoreCodes64(pick, cm, prev_code_m + i);
      QStoreCodes64(pick, cv, prev_code_v + i);
    }
  }
  float am = _mm512_reduce_max_ps(amax_m), av;
  const uint32_t top = _mm512_reduce_max_epu32(top_v);
  std::memcpy(&av, &top, 4);
  if (top > 0x7F7FFFFFu || !std::isfinite(am) || !finite_scale ||
      (sum && _mm512_fpclass_ps_mask(sum_m, 0x99) != 0)) {  // 0x99: NaN, +-inf
    am = Sanitize(false, block, xm);
    av = Sanitize(true, block, xv);
  }
  bufs[0].scales[blk_m] = std::max(am, kScaleFloor);
  bufs[1].scales[blk_v] = std::max(av, kScaleFloor);
}

template <int64_t kind, bool nesterov, int64_t decay>
ADAMKIT_AVX512 void QuantBlocksAvx512(const QLeaf& l, const QBuffer* bufs, int64_t block,
                                      const float* s, int64_t j0, int64_t j1) {
  const Scalars sc = LoadScalars(s);
  const Scalars16 k{_mm512_set1_ps(sc.b1),   _mm512_set1_ps(sc.omb1), _mm512_set1_ps(sc.b2),
                    _mm512_set1_ps(sc.omb2), _mm512_set1_ps(sc.eps),  _mm512_set1_ps(-sc.lr),
                    _mm512_set1_ps(sc.wd),   _mm512_set1_ps(sc.c1),   _mm512_set1_ps(sc.c2)};
  BookPlanes book_m, book_v;
  LoadPlanes(bufs[0].book, &book_m);
  LoadPlanes(bufs[1].book, &book_v);
  const __m512i order = LaneOrder(), pick = TopBytes();
  alignas(64) float x[2][2][kFastMaxBlock];  // [block parity][m, v]
  const __m512 none = _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    float* p = l.p + j * block;
    const float* g = l.g + j * block;
    const int64_t bm = l.at[0] + j, bv = l.at[1] + j;
    if (j == j0) {
      QBlockAvx512<kind, nesterov, decay, false>(k, bufs, book_m, book_v, order, pick, block, p, g, bm,
                                                 bv, x[j & 1][0], x[j & 1][1], nullptr, nullptr,
                                                 none, none, nullptr, nullptr);
    } else {
      QBlockAvx512<kind, nesterov, decay, true>(
          k, bufs, book_m, book_v, order, pick, block, p, g, bm, bv, x[j & 1][0], x[j & 1][1],
          x[(j - 1) & 1][0], x[(j - 1) & 1][1], _mm512_set1_ps(1.0f / bufs[0].scales[bm - 1]),
          _mm512_set1_ps(1.0f / bufs[1].scales[bv - 1]), bufs[0].codes + (bm - 1) * block,
          bufs[1].codes + (bv - 1) * block);
    }
  }
  if (j1 > j0) {  // the last block's codes
    const int64_t j = j1 - 1, bm = l.at[0] + j, bv = l.at[1] + j;
    const __m512 inv_m = _mm512_set1_ps(1.0f / bufs[0].scales[bm]);
    const __m512 inv_v = _mm512_set1_ps(1.0f / bufs[1].scales[bv]);
    for (int64_t i = 0; i < block; i += 64) {
      QEncode64<false>(*bufs[0].search, pick, x[j & 1][0] + i, inv_m, bufs[0].codes + bm * block + i);
      QEncode64<true>(*bufs[1].search, pick, x[j & 1][1] + i, inv_v, bufs[1].codes + bv * block + i);
    }
  }
}
#endif

// The fast pass of RunBlocks for a variant and its buffers, or nullptr where there is none.
using QuantFn = void (*)(const QLeaf&, const QBuffer*, int64_t, const float*, int64_t, int64_t);

template <int64_t kind, bool nesterov>
QuantFn PickQuantDecay(int64_t decay, bool avx512) {
#ifdef ADAMKIT_AVX2
  if (avx512) {
    if (decay == kL2) return QuantBlocksAvx512<kind, nesterov, kL2>;
    if (decay == kDecoupled) return QuantBlocksAvx512<kind, nesterov, kDecoupled>;
    return QuantBlocksAvx512<kind, nesterov, kNoDecay>;
  }
  if (decay == kL2) return QuantBlocksAvx2<kind, nesterov, kL2>;
  if (decay == kDecoupled) return QuantBlocksAvx2<kind, nesterov, kDecoupled>;
  return QuantBlocksAvx2<kind, nesterov, kNoDecay>;
#else
  return nullptr;
#endif
}

// What QBlockAvx512's test for a NaN first moment assumes in Adam: b1 finite, |1 - b1| <= 1
// and the first moment's code book within [-1, 1] (the formats' books are).
bool FirstMomentBounded(const float* book, const float* s) {
  const Scalars k = LoadScalars(s);
  if (!std::isfinite(k.b1) || !(std::fabs(k.omb1) <= 1.0f)) return false;
  for (int64_t i = 0; i < kBook; ++i) {
    if (!(std::fabs(book[i]) <= 1.0f)) return false;
  }
  return true;
}

QuantFn PickQuant(int64_t kind, bool nesterov, int64_t decay, bool amsgrad, const QBuffer* bufs,
                  int64_t block, const float* s) {
#ifdef ADAMKIT_AVX2
  if (!HasAvx2() || amsgrad || block < 8 || block > kFastMaxBlock) return nullptr;
  if (!bufs[0].quantized || !bufs[1].quantized || !bufs[0].search->fast() ||
      !bufs[1].search->fast()) {
    return nullptr;
  }
  const bool avx512 = block >= 64 && HasAvx512Vbmi() &&
                      (kind == kAdamax || FirstMomentBounded(bufs[0].book, s));
  if (kind == kAdamax) return PickQuantDecay<kAdamax, false>(decay, avx512);
  if (kind == kAdamHat) {
    return nesterov ? PickQuantDecay<kAdamHat, true>(decay, avx512)
                    : PickQuantDecay<kAdamHat, false>(decay, avx512);
  }
  return nesterov ? PickQuantDecay<kAdamCorrected, true>(decay, avx512)
                  : PickQuantDecay<kAdamCorrected, false>(decay, avx512);
#else
  return nullptr;
#endif
}

// The step on blocks [lo, hi) of the concatenated leaves (each leaf starts a block): the
// block's quantized moments decoded into scratch, the float32 step's loop `fn`, encoded.
void RunBlocks(ChunkFn fn, QuantFn fast, const std::vector<QLeaf>& leaves, const QBuffer* bufs,
               int64_t nstate, int64_t block, const float* s, int64_t lo, int64_t hi) {
  std::vector<float> scratch(static_cast<size_t>(nstate * block));
  int64_t base = 0;
  for (const QLeaf& l : leaves) {
    const int64_t nb = (l.n + block - 1) / block;
    int64_t j = std::max(lo, base) - base;
    const int64_t end = std::min(hi, base + nb) - base;
    if (fast != nullptr) {  // the whole blocks
      const int64_t whole = std::min(end, l.n / block);
      if (j < whole) fast(l, bufs, block, s, j, whole);
      j = std::max(j, whole);
    }
    for (; j < end; ++j) {
      const int64_t e0 = j * block, c = std::min(block, l.n - e0);
      float* x[kMaxStateBuffers] = {nullptr, nullptr, nullptr};
      for (int64_t k = 0; k < nstate; ++k) {
        if (bufs[k].quantized) {
          x[k] = scratch.data() + k * block;
          Decode(bufs[k], block, l.at[k] + j, c, x[k]);
        } else {
          x[k] = bufs[k].f + l.at[k] + e0;
        }
      }
      fn(l.p + e0, x[0], x[1], x[2], l.g + e0, s, 0, c);
      for (int64_t k = 0; k < nstate; ++k) {
        if (bufs[k].quantized) EncodeBlock(bufs[k], block, l.at[k] + j, c, x[k]);
      }
    }
    base += nb;
    if (base >= hi) break;
  }
}

// Arguments: scalars (f32[9], as the float32 step), L params and L gradients (float32),
// then per state buffer k (first moment, second moment, AMSGrad's running maximum):
// float32 moments, or when quantized[k], its codes (u8, `block` per scale), scales
// (f32), code book (f32[256], sorted) and midpoints (f32[255]). The leaves lie back to
// back in each buffer from offsets[k]: elements of a float32 buffer, blocks of a
// quantized one, where each leaf starts a block (the last block of a leaf is padded).
// Results: the L params, then per buffer its moments or its codes and scales (aliased
// to the inputs when donated). Every buffer is checked against its own size.
ffi::Error StepQuantized(ffi::ThreadPool pool, ffi::BufferR1<ffi::F32> scalars,
                         ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t kind,
                         bool nesterov, int64_t decay, bool amsgrad, int64_t state,
                         ffi::Span<const int64_t> quantized, ffi::Span<const int64_t> offsets,
                         int64_t block) {
  auto bad = [](const std::string& what) {
    return ffi::Error::InvalidArgument("adamkit quantized step: " + what);
  };
  if (scalars.element_count() != 9) return bad("expected 9 scalars");
  const std::string variant = VariantError(kind, nesterov, decay, amsgrad, state);
  if (!variant.empty()) return bad(variant);
  const int64_t nstate = state;
  if (static_cast<int64_t>(quantized.size()) != nstate ||
      static_cast<int64_t>(offsets.size()) != nstate) {
    return bad("attributes quantized and offsets must have one entry per state buffer (" +
               Str(nstate) + "), got " + Str(static_cast<int64_t>(quantized.size())) + " and " +
               Str(static_cast<int64_t>(offsets.size())));
  }
  if (block < 1 || block > kMaxBlock || (block & (block - 1)) != 0) {
    return bad("attribute block = " + Str(block) + " must be a power of two in [1, 2^20]");
  }
  int64_t state_args = 0, state_rets = 0;
  for (int64_t k = 0; k < nstate; ++k) {
    if (offsets[k] < 0) {
      return bad("attribute offsets[" + Str(k) + "] = " + Str(offsets[k]) + " must be >= 0");
    }
    if (quantized[k] != 0 && quantized[k] != 1) {
      return bad("attribute quantized[" + Str(k) + "] = " + Str(quantized[k]) + " must be 0 or 1");
    }
    state_args += quantized[k] ? 4 : 1;
    state_rets += quantized[k] ? 2 : 1;
  }
  const int64_t nargs = static_cast<int64_t>(args.size());
  if (nargs < 2 + state_args || (nargs - state_args) % 2 != 0 ||
      static_cast<int64_t>(rets.size()) != (nargs - state_args) / 2 + state_rets) {
    return bad("expected 2L+S' arguments and L+S'' results");
  }
  const int64_t num = (nargs - state_args) / 2;

  QBuffer bufs[kMaxStateBuffers];
  int64_t units[kMaxStateBuffers] = {0, 0, 0};  // elements (float32) or blocks (quantized)
  for (int64_t k = 0, a = 2 * num, r = num; k < nstate; ++k) {
    QBuffer& b = bufs[k];
    b.quantized = quantized[k] != 0;
    b.nonneg = k > 0;
    if (!b.quantized) {
      auto in = args.get<ffi::Buffer<ffi::F32>>(a++);
      auto out = rets.get<ffi::Buffer<ffi::F32>>(r++);
      if (in.has_error()) return in.error();
      if (out.has_error()) return out.error();
      units[k] = static_cast<int64_t>(in->element_count());
      if (static_cast<int64_t>((*out)->element_count()) != units[k]) {
        return bad("a moment result differs from its input");
      }
      b.f = (*out)->typed_data();
      if (b.f != in->typed_data()) std::copy_n(in->typed_data(), units[k], b.f);
      continue;
    }
    auto codes = args.get<ffi::Buffer<ffi::U8>>(a++);
    auto scales = args.get<ffi::Buffer<ffi::F32>>(a++);
    auto book = args.get<ffi::Buffer<ffi::F32>>(a++);
    auto mid = args.get<ffi::Buffer<ffi::F32>>(a++);
    auto codes_out = rets.get<ffi::Buffer<ffi::U8>>(r++);
    auto scales_out = rets.get<ffi::Buffer<ffi::F32>>(r++);
    if (codes.has_error()) return codes.error();
    if (scales.has_error()) return scales.error();
    if (book.has_error()) return book.error();
    if (mid.has_error()) return mid.error();
    if (codes_out.has_error()) return codes_out.error();
    if (scales_out.has_error()) return scales_out.error();
    units[k] = static_cast<int64_t>(scales->element_count());
    const int64_t ncodes = static_cast<int64_t>(codes->element_count());
    int64_t expected = 0;
    if (__builtin_mul_overflow(units[k], block, &expected) || ncodes != expected ||
        static_cast<int64_t>((*codes_out)->element_count()) != ncodes ||
        static_cast<int64_t>((*scales_out)->element_count()) != units[k]) {
      return bad("codes must be `block` per scale, results as the inputs");
    }
    if (book->element_count() != kBook || mid->element_count() != kBook - 1) {
      return bad("a code book is 256 values and 255 midpoints");
    }
    b.book = book->typed_data();
    for (int64_t i = 0; i < kBook; ++i) {
      if (!std::isfinite(b.book[i])) return bad("a code book value is not finite");
    }
    b.search = SearchFor(mid->typed_data());
    if (b.search == nullptr) return bad("the midpoints must be finite and sorted");
    b.codes = (*codes_out)->typed_data();
    b.scales = (*scales_out)->typed_data();
    if (b.codes != codes->typed_data()) std::copy_n(codes->typed_data(), ncodes, b.codes);
    if (b.scales != scales->typed_data()) std::copy_n(scales->typed_data(), units[k], b.scales);
  }
  for (int64_t k = 0; k < nstate; ++k) {
    if (offsets[k] > units[k]) {
      return bad("attribute offsets[" + Str(k) + "] = " + Str(offsets[k]) + " must be in [0, " +
                 Str(units[k]) + "] (the state buffer's " + (bufs[k].quantized ? "blocks" : "elements") +
                 ")");
    }
  }

  std::vector<QLeaf> leaves(num);
  int64_t used[kMaxStateBuffers] = {0, 0, 0};  // per buffer, in its units
  int64_t blocks = 0;
  for (int64_t i = 0; i < num; ++i) {
    auto p = args.get<ffi::Buffer<ffi::F32>>(i);
    auto g = args.get<ffi::Buffer<ffi::F32>>(num + i);
    auto p_out = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (p.has_error()) return p.error();
    if (g.has_error()) return g.error();
    if (p_out.has_error()) return p_out.error();
    const int64_t n = static_cast<int64_t>(p->element_count());
    if (static_cast<int64_t>(g->element_count()) != n ||
        static_cast<int64_t>((*p_out)->element_count()) != n) {
      return bad("a gradient differs from its param");
    }
    const int64_t nb = (n + block - 1) / block;
    QLeaf& l = leaves[i];
    for (int64_t k = 0; k < nstate; ++k) {  // offsets[k] + used[k] <= units[k] (so far)
      const int64_t need = bufs[k].quantized ? nb : n;
      if (need > units[k] - offsets[k] - used[k]) {
        return bad("a state buffer (" + Str(units[k]) + (bufs[k].quantized ? " blocks" : " elements") +
                   ") is smaller than its params from attribute offsets[" + Str(k) + "] = " +
                   Str(offsets[k]));
      }
      l.at[k] = offsets[k] + used[k];
      used[k] += need;
    }
    l.p = (*p_out)->typed_data();
    if (l.p != p->typed_data()) std::copy_n(p->typed_data(), n, l.p);
    l.g = g->typed_data();
    l.n = n;
    blocks += nb;
  }
  ChunkFn fn = Pick(kind, nesterov, decay, amsgrad);
  const float* s = scalars.typed_data();
  QuantFn fast = PickQuant(kind, nesterov, decay, amsgrad, bufs, block, s);

  constexpr int64_t kMinPerChunk = 1 << 16;  // elements, as the float32 step
  const int64_t total = blocks * block;
  if (total < 2 * kMinPerChunk) {
    RunBlocks(fn, fast, leaves, bufs, nstate, block, s, 0, blocks);
    return ffi::Error::Success();
  }
  // Small chunks, about 32 per thread (0.2 ms each at 16M parameters), claimed as the threads
  // go: a thread that starts late or that the OS preempts (the machine may be shared) then
  // holds the step back by one small chunk, not by a quarter of the work. Their number costs
  // nothing measurable (a chunk's setup is a few microseconds).
  const int64_t per = std::max<int64_t>(kMinPerChunk, total / (32 * Threads(pool)));
  ParallelFor(pool, blocks, (per + block - 1) / block,
              [&leaves, &bufs, fn, fast, s, nstate, block](int64_t lo, int64_t hi) {
                RunBlocks(fn, fast, leaves, bufs, nstate, block, s, lo, hi);
              });
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(AdamkitCpuStepRounded, StepRounded,
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
                                  .Attr<int64_t>("state")
                                  .Attr<int64_t>("rounding")
                                  .Attr<bool>("grads_f32"));

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(AdamkitCpuStepQuantized, StepQuantized,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR1<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("kind")
                                  .Attr<bool>("nesterov")
                                  .Attr<int64_t>("decay")
                                  .Attr<bool>("amsgrad")
                                  .Attr<int64_t>("state")
                                  .Attr<ffi::Span<const int64_t>>("quantized")
                                  .Attr<ffi::Span<const int64_t>>("offsets")
                                  .Attr<int64_t>("block"));

// ---------------------------------------------------------------------------------------
// The chain form's requantization (AdamkitCpuRequantize). Under jit, ak.scale_by_adam and
// ak.scale_by_adamax with "8bit" moments compute the direction u in XLA, elementwise from
// the old codes (fused into optax.apply_updates' add, never materialized), and the new
// codes here: per block, in one pass over memory, decode the old moments into scratch, step
// them with the moment rows of Update (the same operations in the same order, no FMA; the
// direction is not needed), and encode them into fresh output buffers as EncodeBlock does
// for the fused step. The outputs are never the inputs (XLA still reads the old codes for
// u), so a block is read whole before any of its codes is written either way.
namespace {

// Update's moment rows on the c elements of one block. AdaMax's norm is XLA's
// jnp.maximum(b2 v, |g|): NaN where g is NaN (stored as 0), where Update's std::max keeps
// b2 v.
template <int64_t kind, bool amsgrad>
inline __attribute__((always_inline)) void MomentRows(const Scalars& k, const float* __restrict g,
                                                      float* __restrict m, float* __restrict v,
                                                      float* __restrict vmax, int64_t c) {
  static_assert(!(amsgrad && kind == kAdamax), "AdaMax has no AMSGrad form");
  for (int64_t i = 0; i < c; ++i) {
    const float gi = g[i];
    m[i] = k.b1 * m[i] + k.omb1 * gi;
    if (kind == kAdamax) {
      const float decayed = k.b2 * v[i], norm = std::fabs(gi);
      v[i] = (norm != norm || norm > decayed) ? norm : decayed;
    } else {
      const float vi = k.b2 * v[i] + k.omb2 * (gi * gi);
      v[i] = vi;
      if (amsgrad) {
        const float old = vmax[i];
        vmax[i] = (vi != vi || vi > old) ? vi : old;
      }
    }
  }
}

using MomentFn = void (*)(const Scalars&, const float*, float*, float*, float*, int64_t);

template <int64_t kind, bool amsgrad>
void Moments(const Scalars& k, const float* g, float* m, float* v, float* vmax, int64_t c) {
  MomentRows<kind, amsgrad>(k, g, m, v, vmax, c);
}

#ifdef ADAMKIT_AVX2
template <int64_t kind, bool amsgrad>
__attribute__((target("avx2"))) void MomentsAvx2(const Scalars& k, const float* g, float* m,
                                                 float* v, float* vmax, int64_t c) {
  MomentRows<kind, amsgrad>(k, g, m, v, vmax, c);
}
#endif

template <int64_t kind, bool amsgrad>
MomentFn MomentInstance() {
#ifdef ADAMKIT_AVX2
  if (HasAvx2()) return MomentsAvx2<kind, amsgrad>;
#endif
  return Moments<kind, amsgrad>;
}

// The handler has checked the variant (VariantError): AMSGrad for Adam only.
MomentFn PickMoments(int64_t kind, bool amsgrad) {
  if (kind == kAdamax) return MomentInstance<kAdamax, false>();
  return amsgrad ? MomentInstance<kAdamHat, true>() : MomentInstance<kAdamHat, false>();
}

#ifdef ADAMKIT_AVX2
// The pass in AVX-512 (with VBMI), for whole blocks of 64 to kRequantMaxBlock elements whose
// code books have CodeSearch's table: 64 elements per step, the old moments decoded by the
// fused step's byte permutes (QDecode64), stepped (MomentRows' operations), kept in a stack
// buffer with the block's largest magnitudes, then encoded by CodeSearch::Codes16At (the
// code in byte 2 of each lane). Sanitize's work is left out where every new moment is
// finite (a second moment is then non-negative: b2 v + (1 - b2) g^2 of a decoded v >= 0,
// and AdaMax's max(b2 v, |g|)); a block with a NaN or an infinity goes through
// EncodeBlock instead.
#define ADAMKIT_REQUANT_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vbmi")))
constexpr int64_t kRequantMaxBlock = 2048;  // the stack buffers' block size bound (48 KiB)
constexpr int64_t kRequantAhead = 1024;     // elements prefetched ahead

bool RequantHasAvx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vbmi");
  }();
  return has;
}

// Codes of x[0 .. 16) * inv (CodeSearch::Codes16At, byte 2 of each lane, the table at
// `table`), stored at out.
template <bool nonneg>
ADAMKIT_REQUANT_AVX512 __attribute__((always_inline)) inline void RequantEncode16(
    const uint32_t* table, const float* x, __m512 inv, uint8_t* out) {
  const __m512i t = CodeSearch::Codes16At<nonneg>(table, _mm512_mul_ps(_mm512_load_ps(x), inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(_mm512_srli_epi32(t, 16)));
}

// Blocks [lo, hi), all whole. The codes of block j - 1 are encoded in the loop that decodes
// and steps block j, sixteen before each step of sixteen: their gathers from the code
// table then overlap the permutes and the arithmetic (as in QBlockAvx512; measured in a
// C++ harness against all 64 after the steps: 16% less time in cache on one thread, 9%
// from memory on two).
template <int64_t kind, bool amsgrad>
ADAMKIT_REQUANT_AVX512 void RequantizeBlocksAvx512(const Scalars& sc, const float* g,
                                                   const QBuffer* in, const QBuffer* out,
                                                   int64_t block, int64_t lo, int64_t hi) {
  constexpr int64_t nstate = amsgrad ? 3 : 2;
  const __m512 b1 = _mm512_set1_ps(sc.b1), omb1 = _mm512_set1_ps(sc.omb1);
  const __m512 b2 = _mm512_set1_ps(sc.b2), omb2 = _mm512_set1_ps(sc.omb2);
  const __m512 zero = _mm512_setzero_ps();
  const __m512i order = LaneOrder();
  BookPlanes books[nstate];
  const uint32_t* tables[nstate];
  for (int64_t s = 0; s < nstate; ++s) {
    LoadPlanes(in[s].book, &books[s]);
    tables[s] = out[s].search->Base();
  }
  alignas(64) float x[2][nstate][kRequantMaxBlock];  // [block parity][moment]
  bool pending = false;  // block j - 1's codes are still to be written (from x[(j - 1) & 1])
  __m512 inv[nstate];    // and the reciprocals of its scales
  for (int64_t j = lo; j < hi; ++j) {
    float (*cur)[kRequantMaxBlock] = x[j & 1];
    float (*prev)[kRequantMaxBlock] = x[(j - 1) & 1];
    const float* gj = g + j * block;
    const uint8_t* code[nstate];
    uint8_t* prev_code[nstate];
    __m512 scale[nstate], amax[nstate];
    for (int64_t s = 0; s < nstate; ++s) {
      code[s] = in[s].codes + j * block;
      prev_code[s] = out[s].codes + (j - 1) * block;
      scale[s] = _mm512_set1_ps(in[s].scales[j]);
      amax[s] = zero;
    }
    __mmask16 bad = 0;  // lanes where a new moment is NaN or infinite
    for (int64_t i = 0; i < block; i += 64) {
      for (int64_t q = 0; q < 4; ++q) {
        _mm_prefetch(reinterpret_cast<const char*>(gj + i + kRequantAhead + 16 * q), _MM_HINT_T0);
      }
      for (int64_t s = 0; s < nstate; ++s) {
        _mm_prefetch(reinterpret_cast<const char*>(code[s] + i + kRequantAhead), _MM_HINT_T0);
      }
      __m512 y[nstate][4];
      for (int64_t s = 0; s < nstate; ++s) QDecode64(books[s], order, code[s] + i, scale[s], y[s]);
      for (int64_t q = 0; q < 4; ++q) {
        if (pending) {
          const int64_t at = i + 16 * q;
          RequantEncode16<false>(tables[0], prev[0] + at, inv[0], prev_code[0] + at);
          for (int64_t s = 1; s < nstate; ++s) {
            RequantEncode16<true>(tables[s], prev[s] + at, inv[s], prev_code[s] + at);
          }
        }
        const __m512 gi = _mm512_loadu_ps(gj + i + 16 * q);
        y[0][q] = _mm512_add_ps(_mm512_mul_ps(b1, y[0][q]), _mm512_mul_ps(omb1, gi));
        if (kind == kAdamax) {
          // (|g| is NaN || |g| > b2 v) ? |g| : b2 v, as MomentRows
          const __m512 decayed = _mm512_mul_ps(b2, y[1][q]);
          const __m512 norm = _mm512_abs_ps(gi);
          y[1][q] = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(norm, decayed, _CMP_NLE_UQ), decayed, norm);
        } else {
          y[1][q] = _mm512_add_ps(_mm512_mul_ps(b2, y[1][q]),
                                  _mm512_mul_ps(omb2, _mm512_mul_ps(gi, gi)));
          if (amsgrad) {  // (v is NaN || v > vmax) ? v : vmax
            y[2][q] = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(y[1][q], y[2][q], _CMP_NLE_UQ),
                                           y[2][q], y[1][q]);
          }
        }
        for (int64_t s = 0; s < nstate; ++s) {
          bad |= _mm512_fpclass_ps_mask(y[s][q], 0x99);  // NaN, +inf, -inf
          _mm512_store_ps(cur[s] + i + 16 * q, y[s][q]);
          amax[s] = _mm512_max_ps(amax[s], _mm512_abs_ps(y[s][q]));
        }
      }
    }
    pending = bad == 0;
    for (int64_t s = 0; s < nstate; ++s) {
      if (!pending) {
        EncodeBlock(out[s], block, j, block, cur[s]);
        continue;
      }
      const float sj = std::max(_mm512_reduce_max_ps(amax[s]), kScaleFloor);
      out[s].scales[j] = sj;
      inv[s] = _mm512_set1_ps(1.0f / sj);
    }
  }
  if (pending) {  // the last block's codes
    for (int64_t s = 0; s < nstate; ++s) {
      for (int64_t i = 0; i < block; i += 16) {
        uint8_t* dst = out[s].codes + (hi - 1) * block + i;
        if (s == 0) {
          RequantEncode16<false>(tables[0], x[(hi - 1) & 1][0] + i, inv[0], dst);
        } else {
          RequantEncode16<true>(tables[s], x[(hi - 1) & 1][s] + i, inv[s], dst);
        }
      }
    }
  }
}

using RequantFastFn = void (*)(const Scalars&, const float*, const QBuffer*, const QBuffer*,
                               int64_t, int64_t, int64_t);

// The AVX-512 pass for this call, or nullptr (then RequantizeBlocks' general path).
RequantFastFn PickRequantFast(int64_t kind, bool amsgrad, const QBuffer* out, int64_t nstate,
                              int64_t block) {
  if (!RequantHasAvx512() || block < 64 || block > kRequantMaxBlock) return nullptr;
  for (int64_t s = 0; s < nstate; ++s) {
    if (!out[s].search->fast()) return nullptr;
  }
  if (kind == kAdamax) return RequantizeBlocksAvx512<kAdamax, false>;
  return amsgrad ? RequantizeBlocksAvx512<kAdamHat, true> : RequantizeBlocksAvx512<kAdamHat, false>;
}
#endif

// The checks every call of an 8-bit handler starts with: 9 scalars, the variant (no decay),
// a power-of-two block, and 4 arguments (codes, scales, book, midpoints) and 2 results
// (codes, scales) per state buffer, then `more` results. An error message, or "".
std::string CallError(size_t scalars, int64_t kind, bool nesterov, bool amsgrad, int64_t state,
                      int64_t block, size_t args, size_t rets, size_t more) {
  if (scalars != 9) return "expected 9 scalars";
  const std::string variant = VariantError(kind, nesterov, kNoDecay, amsgrad, state);
  if (!variant.empty()) return variant;
  if (block < 1 || block > kMaxBlock || (block & (block - 1)) != 0) {
    return "attribute block = " + Str(block) + " must be a power of two in [1, 2^20]";
  }
  if (args != 4 * static_cast<size_t>(state) || rets != 2 * static_cast<size_t>(state) + more) {
    return "expected 4 arguments (codes, scales, book, midpoints) and 2 results (codes, scales) "
           "per state buffer" + std::string(more ? ", then the ids and directions results" : "");
  }
  return "";
}

// One state buffer of 8-bit codes from arguments at, at + 1, at + 2, at + 3 (codes, scales,
// code book, midpoints) and results ret, ret + 1 (codes, scales): `blocks` scales and
// `block` codes per scale in each, the book 256 finite values, the midpoints 255 finite
// and sorted. Fills *in (to decode) and *out (to encode). An error message, or "".
std::string LoadCodes(ffi::RemainingArgs& args, ffi::RemainingRets& rets, size_t at, size_t ret,
                      int64_t blocks, int64_t block, bool nonneg, QBuffer* in, QBuffer* out) {
  auto codes = args.get<ffi::Buffer<ffi::U8>>(at);
  auto scales = args.get<ffi::Buffer<ffi::F32>>(at + 1);
  auto book = args.get<ffi::Buffer<ffi::F32>>(at + 2);
  auto mid = args.get<ffi::Buffer<ffi::F32>>(at + 3);
  auto codes_out = rets.get<ffi::Buffer<ffi::U8>>(ret);
  auto scales_out = rets.get<ffi::Buffer<ffi::F32>>(ret + 1);
  if (codes.has_error() || scales.has_error() || book.has_error() || mid.has_error() ||
      codes_out.has_error() || scales_out.has_error()) {
    return "a state buffer is u8 codes, f32 scales, an f32 code book and f32 midpoints";
  }
  if (static_cast<int64_t>(scales->element_count()) != blocks ||
      static_cast<int64_t>((*scales_out)->element_count()) != blocks) {
    return "scales must be one per block of the gradient, results as the inputs";
  }
  if (static_cast<int64_t>(codes->element_count()) != blocks * block ||  // caller: no overflow
      static_cast<int64_t>((*codes_out)->element_count()) != blocks * block) {
    return "codes must be `block` per scale, results as the inputs";
  }
  if (book->element_count() != kBook || mid->element_count() != kBook - 1) {
    return "a code book is 256 values and 255 midpoints";
  }
  const float* values = book->typed_data();
  for (int64_t i = 0; i < kBook; ++i) {
    if (!std::isfinite(values[i])) return "a code book value is not finite";
  }
  in->quantized = out->quantized = true;
  in->nonneg = out->nonneg = nonneg;
  in->codes = codes->typed_data();
  in->scales = scales->typed_data();
  in->book = out->book = values;
  out->codes = (*codes_out)->typed_data();
  out->scales = (*scales_out)->typed_data();
  out->search = SearchFor(mid->typed_data());
  if (out->search == nullptr) return "the midpoints must be finite and sorted";
  return "";
}

// Blocks [lo, hi) of a leaf of n elements: the old moments of block j from in[k] (codes,
// scales, book), the new ones into out[k] (codes, scales, search).
void RequantizeBlocks(MomentFn moments, const Scalars& k, const float* g, int64_t n,
                      const QBuffer* in, const QBuffer* out, int64_t nstate, int64_t block,
                      int64_t lo, int64_t hi) {
  std::vector<float> scratch(static_cast<size_t>(nstate * block));
  float* x[kMaxStateBuffers] = {nullptr, nullptr, nullptr};
  for (int64_t s = 0; s < nstate; ++s) x[s] = scratch.data() + s * block;
  for (int64_t j = lo; j < hi; ++j) {
    const int64_t e0 = j * block, c = std::min(block, n - e0);
    for (int64_t s = 0; s < nstate; ++s) Decode(in[s], block, j, c, x[s]);
    moments(k, g + e0, x[0], x[1], x[2], c);
    for (int64_t s = 0; s < nstate; ++s) EncodeBlock(out[s], block, j, c, x[s]);
  }
}

// Arguments: scalars (f32[9], the float32 step's; the moment rows read b1, 1-b1, b2,
// 1-b2), the gradient g (float32, n elements, any shape), then per state buffer (first
// moment, second moment or AdaMax's norm, AMSGrad's running maximum) its old codes (u8,
// `block` per scale), scales (f32, one per block of g: ceil(n / block)), code book
// (f32[256], sorted) and midpoints (f32[255]). Results: per state buffer its new codes and
// scales, shaped as the old. Blocks are `block` consecutive elements of g in C order, the
// last one padded (as adamkit/_quant.py lays out every leaf). Every buffer is checked
// against its own size before any is read.
ffi::Error Requantize(ffi::ThreadPool pool, ffi::BufferR1<ffi::F32> scalars,
                      ffi::Buffer<ffi::F32> grad, ffi::RemainingArgs args,
                      ffi::RemainingRets rets, int64_t kind, bool amsgrad, int64_t state,
                      int64_t block) {
  auto bad = [](const std::string& what) {
    return ffi::Error::InvalidArgument("adamkit requantize: " + what);
  };
  const std::string call = CallError(scalars.element_count(), kind, false, amsgrad, state, block,
                                     args.size(), rets.size(), 0);
  if (!call.empty()) return bad(call);
  const int64_t nstate = state;
  const int64_t n = static_cast<int64_t>(grad.element_count());
  const int64_t blocks = (n + block - 1) / block;
  QBuffer in[kMaxStateBuffers], out[kMaxStateBuffers];
  for (int64_t s = 0; s < nstate; ++s) {
    const std::string error = LoadCodes(args, rets, 4 * s, 2 * s, blocks, block, s > 0, &in[s],
                                        &out[s]);
    if (!error.empty()) return bad(error);
  }
  const MomentFn moments = PickMoments(kind, amsgrad);
  const Scalars k = LoadScalars(scalars.typed_data());
  const float* g = grad.typed_data();
  const int64_t whole = n / block;  // the fast pass takes whole blocks only
#ifdef ADAMKIT_AVX2
  const RequantFastFn fast = PickRequantFast(kind, amsgrad, out, nstate, block);
#else
  const void* fast = nullptr;
#endif
  constexpr int64_t kMinPerChunk = 1 << 16;  // elements, as the float32 step
  const int64_t per = std::max<int64_t>(kMinPerChunk, blocks * block / (4 * Threads(pool)));
  ParallelFor(pool, blocks, (per + block - 1) / block,
              [moments, fast, &k, g, n, whole, &in, &out, nstate, block](int64_t lo, int64_t hi) {
                int64_t j = lo;
#ifdef ADAMKIT_AVX2
                if (fast != nullptr && j < std::min(hi, whole)) {
                  fast(k, g, in, out, block, j, std::min(hi, whole));
                  j = std::min(hi, whole);
                }
#endif
                RequantizeBlocks(moments, k, g, n, in, out, nstate, block, j, hi);
              });
  return ffi::Error::Success();
}

// The lazy sparse step with 8-bit moments (the chain form: directions out, no table): as
// SparseLazy without apply, each state buffer stored as the table's own codes, `block`
// codes per scale, every row whole blocks. Per distinct row: its blocks decoded, the step
// of the float32 kernel, the new moments encoded into the row's blocks, as the dense
// quantized step encodes (adamkit/_quant.py, bit for bit); no other row's codes or scales
// are touched. Arguments: scalars (f32[9]), ids (s32[k]), gradient rows (f32[k, *row]),
// then per state buffer its codes (u8, num_rows rows of the row's width), scales (f32, one
// per block), code book (f32[256]) and midpoints (f32[255]). Results: per state buffer
// its codes and scales (in place when donated), then the distinct ids and directions.
ffi::Error SparseLazyQuantized(ffi::ThreadPool pool, ffi::BufferR1<ffi::F32> scalars,
                               ffi::BufferR1<ffi::S32> ids, ffi::Buffer<ffi::F32> grad,
                               ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t kind,
                               bool nesterov, bool amsgrad, int64_t state, bool merge,
                               int64_t rows, int64_t block) {
  auto bad = [](const std::string& what) {
    return ffi::Error::InvalidArgument("adamkit quantized sparse step: " + what);
  };
  const std::string call = CallError(scalars.element_count(), kind, nesterov, amsgrad, state,
                                     block, args.size(), rets.size(), 2);
  if (!call.empty()) return bad(call);
  const int64_t nstate = state;
  if (rows < 0 || rows > INT32_MAX) {
    return bad("attribute num_rows = " + Str(rows) + " must be in [0, 2^31 - 1]");
  }
  const int64_t k = static_cast<int64_t>(ids.element_count());
  const auto dims = grad.dimensions();
  int64_t width = 1, rows_size = 0, k_size = 0;
  if (dims.size() < 1 || dims[0] != k || k > INT32_MAX || !CountOf(dims, 1, &width) ||
      __builtin_mul_overflow(width, k, &k_size) ||
      k_size != static_cast<int64_t>(grad.element_count())) {
    return bad("gradient rows do not match ids");
  }
  if (width % block != 0 || width > kMaxBlock) {
    return bad("a row of " + Str(width) + " elements must be whole blocks of attribute block = " +
               Str(block) + " and at most 2^20 elements");
  }
  if (__builtin_mul_overflow(rows, width, &rows_size)) {
    return bad("attribute num_rows = " + Str(rows) + " rows of " + Str(width) +
               " elements overflow int64");
  }
  QBuffer in[kMaxStateBuffers], out[kMaxStateBuffers];
  for (int64_t s = 0; s < nstate; ++s) {
    const std::string error = LoadCodes(args, rets, 4 * s, 2 * s, rows_size / block, block,
                                        s > 0, &in[s], &out[s]);
    if (!error.empty()) return bad(error);
    if (out[s].codes != in[s].codes) std::copy_n(in[s].codes, rows_size, out[s].codes);
    if (out[s].scales != in[s].scales) std::copy_n(in[s].scales, rows_size / block, out[s].scales);
  }
  const DistinctRows d = Distinct(ids.typed_data(), k, rows, merge);
  float* u_out = nullptr;
  const std::string error = WriteDistinct(d, rets, 2 * nstate, k, width, rows, &u_out);
  if (!error.empty()) return bad(error);
  ChunkFn fn = Pick(kind, nesterov, kNoDecay, amsgrad, /*store_u=*/true);
  const float* s = scalars.typed_data();
  const float* g = grad.typed_data();
  const int64_t per_row = width / block;
  const int64_t lines = std::min<int64_t>((width + 63) / 64, 16);  // cache lines of a row's codes
  auto body = [&](int64_t lo, int64_t hi) {
    std::vector<float> acc, scratch(static_cast<size_t>(nstate * width));
    float* x[kMaxStateBuffers] = {nullptr, nullptr, nullptr};
    for (int64_t j = 0; j < nstate; ++j) x[j] = scratch.data() + j * width;
    constexpr int64_t kAhead = 16;  // rows prefetched ahead: random rows miss every cache
    for (int64_t r = lo; r < hi; ++r) {
      if (r + kAhead < hi) {
        const int64_t ahead = static_cast<int64_t>(d.uid[r + kAhead]) * per_row;
        for (int64_t j = 0; j < nstate; ++j) {
          for (int64_t c = 0; c < lines; ++c) __builtin_prefetch(out[j].codes + ahead * block + 64 * c, 1);
          __builtin_prefetch(out[j].scales + ahead, 1);
        }
      }
      const int64_t blk0 = static_cast<int64_t>(d.uid[r]) * per_row;
      for (int64_t j = 0; j < nstate; ++j) {
        for (int64_t b = 0; b < per_row; ++b) {
          float& scale = out[j].scales[blk0 + b];  // a corrupted one reads as 0 (_quant.readable)
          if (!(scale >= 0.0f && scale <= FLT_MAX)) scale = 0.0f;
          Decode(out[j], block, blk0 + b, block, x[j] + b * block);
        }
      }
      fn(u_out + r * width, x[0], x[1], x[2], MergedRow(d, r, g, width, &acc), s, 0, width);
      for (int64_t j = 0; j < nstate; ++j) {
        for (int64_t b = 0; b < per_row; ++b) {
          EncodeBlock(out[j], block, blk0 + b, block, x[j] + b * block);
        }
      }
    }
  };
  const int64_t distinct = static_cast<int64_t>(d.uid.size());
  const int64_t per_chunk = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(width, 1));
  ParallelFor(pool, distinct, std::max(per_chunk, (distinct + Threads(pool) - 1) / Threads(pool)),
              body);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AdamkitCpuSparseLazyQuantized, SparseLazyQuantized,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR1<ffi::F32>>()
                                  .Arg<ffi::BufferR1<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("kind")
                                  .Attr<bool>("nesterov")
                                  .Attr<bool>("amsgrad")
                                  .Attr<int64_t>("state")
                                  .Attr<bool>("merge")
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(AdamkitCpuRequantize, Requantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::BufferR1<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("kind")
                                  .Attr<bool>("amsgrad")
                                  .Attr<int64_t>("state")
                                  .Attr<int64_t>("block"));

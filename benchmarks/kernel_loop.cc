// Times the 8-bit kernel's AVX-512 loops alone, without JAX: the fused AdamW step
// (QuantBlocksAvx512) or the chain form's requantize pass (RequantizeBlocksAvx512) on one
// float32 leaf with 8-bit moments, block 256. Built and run by bench_kernel_loop.py, which
// includes the kernel's source (-DKERNEL_SOURCE) and writes the code books.
//
//   kernel_loop <fused|requantize> <n> <reps> <threads> <flush> <books dir>
//
// Prints the minimum and the median nanoseconds per parameter over the timed reps (the
// first five steps, with fresh gradients, bring the moments to a realistic state and are
// not timed) and a hash of the codes, which is the same for the same n and reps whatever
// the loop's internals (a change that alters the codes shows there). flush: 1 writes a
// 600 MiB buffer before every step, so the step starts with cold caches.
#include KERNEL_SOURCE

#include <chrono>
#include <cstdio>
#include <random>

namespace {

std::vector<float> ReadFloats(const std::string& path, size_t count) {
  std::vector<float> out(count);
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr || std::fread(out.data(), 4, count, f) != count) {
    std::fprintf(stderr, "cannot read %zu floats from %s\n", count, path.c_str());
    std::exit(2);
  }
  std::fclose(f);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: kernel_loop fused|requantize n reps threads flush books_dir\n");
    return 2;
  }
  const std::string what = argv[1];
  const int64_t block = 256;
  const int64_t n = std::atoll(argv[2]) / block * block, nb = n / block;
  const int reps = std::atoi(argv[3]), threads = std::atoi(argv[4]);
  const bool flush = std::atoi(argv[5]) != 0;
  const std::string dir = argv[6];
  if (!HasAvx512Vbmi()) {
    std::printf("skipped: this CPU has no AVX-512 VBMI\n");
    return 0;
  }
  if (n <= 0 || reps < 6 || threads < 1 || threads > 64 ||
      (what != "fused" && what != "requantize")) {
    std::fprintf(stderr, "bad arguments\n");
    return 2;
  }
  const std::vector<float> book_m = ReadFloats(dir + "/book_mu.bin", kBook);
  const std::vector<float> book_v = ReadFloats(dir + "/book_nu.bin", kBook);
  const std::vector<float> mid_m = ReadFloats(dir + "/mid_mu.bin", kBook - 1);
  const std::vector<float> mid_v = ReadFloats(dir + "/mid_nu.bin", kBook - 1);
  std::vector<float> p(n), g(n), scale_m(nb, kScaleFloor), scale_v(nb, kScaleFloor);
  std::vector<uint8_t> code_m(n), code_v(n, 0);
  const uint8_t zero_m = static_cast<uint8_t>(
      std::find(book_m.begin(), book_m.end(), 0.0f) - book_m.begin());
  std::fill(code_m.begin(), code_m.end(), zero_m);
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  for (int64_t i = 0; i < n; ++i) p[i] = normal(rng);

  QBuffer bufs[2];
  bufs[0].quantized = bufs[1].quantized = true;
  bufs[1].nonneg = true;
  bufs[0].codes = code_m.data();
  bufs[1].codes = code_v.data();
  bufs[0].scales = scale_m.data();
  bufs[1].scales = scale_v.data();
  bufs[0].book = book_m.data();
  bufs[1].book = book_v.data();
  bufs[0].search = SearchFor(mid_m.data());
  bufs[1].search = SearchFor(mid_v.data());
  if (bufs[0].search == nullptr || bufs[1].search == nullptr || !bufs[0].search->fast() ||
      !bufs[1].search->fast()) {
    std::fprintf(stderr, "the code books do not take the table search\n");
    return 2;
  }
  const QLeaf leaf{p.data(), g.data(), n, {0, 0, 0}};
  // b1, 1 - b1, b2, 1 - b2, eps, lr, wd, and the bias corrections of step 10
  const float s[9] = {0.9f, 0.1f, 0.999f, 0.001f, 1e-8f, 1e-3f, 0.01f,
                      1.0f / (1.0f - std::pow(0.9f, 10.0f)),
                      1.0f / (1.0f - std::pow(0.999f, 10.0f))};
  const Scalars sc = LoadScalars(s);
  auto run = [&](int64_t lo, int64_t hi) {
    if (what == "fused") {
      QuantBlocksAvx512<kAdamCorrected, false, kDecoupled>(leaf, bufs, block, s, lo, hi);
    } else {
      RequantizeBlocksAvx512<kAdamHat, false>(sc, g.data(), bufs, bufs, block, lo, hi);
    }
  };
  std::vector<char> junk(flush ? size_t{600} << 20 : 0, 1);
  std::vector<double> seconds;
  for (int r = 0; r < reps; ++r) {
    if (r < 5) {
      for (int64_t i = 0; i < n; ++i) g[i] = 0.1f * normal(rng);
    }
    for (size_t i = 0; i < junk.size(); i += 64) junk[i]++;
    const auto t0 = std::chrono::steady_clock::now();
    std::atomic<int64_t> next{0};
    // chunks as the library's step takes them: at least 2^16 parameters, about 32 a thread
    const int64_t chunk = std::max<int64_t>((int64_t{1} << 16) / block, nb / (32 * threads));
    auto drain = [&] {
      for (int64_t lo; (lo = next.fetch_add(chunk)) < nb;) run(lo, std::min(nb, lo + chunk));
    };
    std::vector<std::thread> helpers;
    for (int t = 1; t < threads; ++t) helpers.emplace_back(drain);
    drain();
    for (std::thread& h : helpers) h.join();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  uint64_t hash = 0;
  for (int64_t i = 0; i < n; i += 4097) hash = hash * 31 + code_m[i] + 7 * code_v[i];
  std::vector<double> timed(seconds.begin() + 5, seconds.end());
  std::sort(timed.begin(), timed.end());
  std::printf("%s n=%lld threads=%d flush=%d min %.3f median %.3f ns/param codes %016llx\n",
              what.c_str(), static_cast<long long>(n), threads, flush ? 1 : 0,
              timed.front() * 1e9 / n, timed[timed.size() / 2] * 1e9 / n,
              static_cast<unsigned long long>(hash));
  return 0;
}

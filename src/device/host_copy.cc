#include "src/device/host_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>  // SSE2: part of every x86-64 CPU
#endif

namespace loom {

#if defined(__x86_64__)
void copyStreaming(void* dst, const void* src, size_t n) {
  auto* d = static_cast<uint8_t*>(dst);
  auto* s = static_cast<const uint8_t*>(src);
  size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
  if (head > n) head = n;
  memcpy(d, s, head);
  d += head, s += head, n -= head;
  size_t blocks = n / 64;
  for (size_t i = 0; i < blocks; ++i, d += 64, s += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
  }
  _mm_sfence();
  memcpy(d, s, n - blocks * 64);
}
#else
// Other CPUs (aarch64: Grace) take the C library's memcpy.  aarch64's
// non-temporal store (STNP) is only a hint, and nothing here has measured
// whether it pays on Grace, so there is no fast path of our own yet.
void copyStreaming(void* dst, const void* src, size_t n) { memcpy(dst, src, n); }
#endif

}  // namespace loom

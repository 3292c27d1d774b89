// The copy between a staging buffer and the caller's memory: the one CPU cost a staged transfer cannot avoid.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace dnv {

// Copies n bytes like memcpy. Large copies use non-temporal (streaming) stores: a staged block is written
// once and next read by the device (or, for a read, by the caller much later), so loading the destination's
// cache lines first, as plain stores do, is wasted memory traffic (a third of it, for a copy larger than the
// cache). Small copies stay on memcpy, whose stores leave the data in the cache for a caller about to use it.
inline void bulk_copy(void* dst, const void* src, size_t n) {
#if defined(__SSE2__)
    constexpr size_t kStreamFrom = 64 << 10;
    if (n >= kStreamFrom) {
        auto* d = static_cast<char*>(dst);
        const auto* s = static_cast<const char*>(src);
        // Streaming stores need a 16-byte aligned destination: the first bytes up to it go the plain way.
        size_t head = (16 - reinterpret_cast<uintptr_t>(d) % 16) % 16;
        std::memcpy(d, s, head);
        size_t i = head;
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
            __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
            __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
            __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
            _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
            _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
            _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
            _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
        }
        // Streaming stores are weakly ordered: fence them before the buffer is handed to the device or the
        // request is reported done to another thread.
        _mm_sfence();
        std::memcpy(d + i, s + i, n - i);
        return;
    }
#endif
    std::memcpy(dst, src, n);
}

}  // namespace dnv

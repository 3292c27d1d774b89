#include "tunables.h"

#include <cstdlib>
#include <string>

#include "error.h"

#if !defined(DEEPNVME_DEFAULT_STAGING_BUFFER_BYTES)
#error "the tunables' defaults come from op_builder/tunables.py: build through the op builder"
#endif

namespace dnv {

size_t parse_tunable(const char* env, const char* raw, size_t fallback, size_t multiple, size_t minimum,
                     size_t maximum) {
    std::string text = raw != nullptr ? raw : "";
    size_t a = text.find_first_not_of(" \t");
    if (a == std::string::npos) return fallback;
    size_t b = text.find_last_not_of(" \t");
    std::string t = text.substr(a, b - a + 1);
    size_t digits = 0;
    while (digits < t.size() && t[digits] >= '0' && t[digits] <= '9') ++digits;
    std::string rest = t.substr(digits);
    size_t sp = rest.find_first_not_of(" \t");
    rest = sp == std::string::npos ? "" : rest.substr(sp);
    size_t unit = 1;
    if (rest == "K" || rest == "k") unit = size_t(1) << 10;
    else if (rest == "M" || rest == "m") unit = size_t(1) << 20;
    else if (rest == "G" || rest == "g") unit = size_t(1) << 30;
    else if (!rest.empty()) digits = 0;
    if (digits == 0 || digits > 15)
        throw ArgError(std::string(env) + "='" + text + "' is not a positive integer (optionally with K, M or G)");
    // Compared before multiplying: 15 digits times G does not fit in 64 bits.
    size_t n = std::stoull(t.substr(0, digits));
    if (n > maximum / unit)
        throw ArgError(std::string(env) + "='" + text + "' must be at most " + std::to_string(maximum));
    size_t v = n * unit;
    if (v < minimum) throw ArgError(std::string(env) + "='" + text + "' must be at least " + std::to_string(minimum));
    if (v % multiple != 0)
        throw ArgError(std::string(env) + "='" + text + "' must be a multiple of " + std::to_string(multiple));
    return v;
}

Tunables read_tunables(const std::function<const char*(const char*)>& lookup) {
    Tunables t{};
#define DNV_TUNABLE_READ(field, env, def, multiple, minimum, maximum) \
    t.field = parse_tunable(env, lookup(env), def, multiple, minimum, maximum);
    DNV_TUNABLE_LIST(DNV_TUNABLE_READ)
#undef DNV_TUNABLE_READ
    // Each factor is bounded (<= 1 GiB, <= 65536), so the product cannot wrap.
    if (t.staging_buffers * t.staging_buffer_bytes > DNV_STAGING_POOL_MAX_BYTES)
        throw ArgError("DEEPNVME_STAGING_BUFFERS x DEEPNVME_STAGING_BUFFER_BYTES (" +
                       std::to_string(t.staging_buffers) + " x " + std::to_string(t.staging_buffer_bytes) +
                       ") must be at most " + std::to_string(DNV_STAGING_POOL_MAX_BYTES) + " bytes");
    return t;
}

const Tunables& tunables() {
    static const Tunables values = read_tunables([](const char* env) { return std::getenv(env); });  // a throw leaves it unset: the next call reads again
    return values;
}

}  // namespace dnv

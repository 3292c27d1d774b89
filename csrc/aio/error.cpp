#include "error.h"

#include <cstring>

namespace dnv {

std::string errno_text(int err) {
    char buf[128];
    // GNU strerror_r may return a static string instead of filling buf; use whatever it returns.
#if defined(__GLIBC__) && defined(_GNU_SOURCE)
    return std::string(strerror_r(err, buf, sizeof(buf)));
#else
    if (strerror_r(err, buf, sizeof(buf)) != 0) return "errno " + std::to_string(err);
    return std::string(buf);
#endif
}

}  // namespace dnv

// Runs every registered C++ unit test; exit status 0 only when every check passed.
#include <cstdio>
#include <exception>

#include "check.h"

int main() {
    int broken = 0;
    for (const check::Case& c : check::cases()) {
        const int before = check::failures();
        try {
            c.fn();
        } catch (const std::exception& e) {
            check::fail(__FILE__, __LINE__, std::string(c.name) + " threw: " + e.what());
        }
        const bool ok = check::failures() == before;
        broken += ok ? 0 : 1;
        std::printf("%s %s\n", ok ? "ok  " : "FAIL", c.name);
    }
    std::printf("%zu tests, %d failed, %d failed checks\n", check::cases().size(), broken, check::failures());
    return check::failures() == 0 && !check::cases().empty() ? 0 : 1;
}

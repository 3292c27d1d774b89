// A minimal test harness for the C++ unit tests (no framework, no dependency): TEST(name) registers a
// function, CHECK* record a failure with file and line and let the test go on, main.cpp runs every test and
// exits non-zero when any check failed. A test that throws fails with the exception's text.
#pragma once

#include <cstdio>
#include <exception>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace check {

struct Case {
    const char* name;
    std::function<void()> fn;
};

inline std::vector<Case>& cases() {
    static std::vector<Case> all;
    return all;
}

inline int& failures() {
    static int n = 0;
    return n;
}

inline void fail(const char* file, int line, const std::string& what) {
    ++failures();
    std::fprintf(stderr, "%s:%d: FAILED: %s\n", file, line, what.c_str());
}

struct Register {
    Register(const char* name, std::function<void()> fn) { cases().push_back({name, std::move(fn)}); }
};

template <typename A, typename B>
void equal(const A& a, const B& b, const char* as, const char* bs, const char* file, int line) {
    if (a == b) return;
    std::ostringstream out;
    out << as << " == " << bs << " (" << a << " != " << b << ")";
    fail(file, line, out.str());
}

}  // namespace check

#define CHECK_CAT2(a, b) a##b
#define CHECK_CAT(a, b) CHECK_CAT2(a, b)
#define TEST(name)                                                            \
    static void name();                                                       \
    static const check::Register CHECK_CAT(register_, name)(#name, &name);   \
    static void name()

#define CHECK(cond) \
    ((cond) ? (void)0 : check::fail(__FILE__, __LINE__, #cond))
#define CHECK_EQ(a, b) check::equal((a), (b), #a, #b, __FILE__, __LINE__)
// `expr` throws `type` whose what() contains `text`.
#define CHECK_THROWS(expr, type, text)                                                               \
    do {                                                                                             \
        bool thrown_ = false;                                                                        \
        try {                                                                                        \
            (void)(expr);                                                                            \
        } catch (const type& e_) {                                                                   \
            thrown_ = true;                                                                          \
            if (std::string(e_.what()).find(text) == std::string::npos)                              \
                check::fail(__FILE__, __LINE__, std::string(#expr " threw '") + e_.what() +         \
                                                    "' without '" + (text) + "'");                   \
        }                                                                                            \
        if (!thrown_) check::fail(__FILE__, __LINE__, #expr " did not throw " #type);                \
    } while (0)

// Catch2 for loom's tests, version 2 (Debian 12's catch2 2.13) or 3
// (Debian 13's catch2 3.7): every test file includes this, not Catch2's own
// headers.  tests/CMakeLists.txt defines LOOM_CATCH2_MAJOR from the package
// it found.  Version 3 splits the single header, renames the string matcher
// and moves Approx into its namespace; the two names tests use are given one
// spelling here.
#pragma once

#include <string>

#if LOOM_CATCH2_MAJOR >= 3
#include <catch2/catch_all.hpp>
using Catch::Approx;
namespace loom_test {
inline auto contains(const std::string& text) { return Catch::Matchers::ContainsSubstring(text); }
}  // namespace loom_test
#else
#include <catch2/catch.hpp>
namespace loom_test {
inline auto contains(const std::string& text) { return Catch::Matchers::Contains(text); }
}  // namespace loom_test
#endif

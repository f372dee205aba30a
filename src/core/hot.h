// LOOM_HOT marks the functions a small blocking collective runs through
// (API entry, ticket, tuner lookup, the one-shot paths, the host
// reductions).  GCC places hot functions in .text.hot, which the linker
// keeps together, so that path spans a few code pages instead of twenty.
// That matters most with more ranks than cores: every operation then
// resumes each rank after another process ran on its CPU, and each page
// it touches again can cost a TLB refill (docs/algorithms.md, the pull
// line, has the measurement).
#pragma once

#if defined(__GNUC__)
#define LOOM_HOT __attribute__((hot))
#else
#define LOOM_HOT
#endif

// Side streams for calls captured into CUDA graphs.
//
// A program on several streams forks its side streams from the caller's
// and joins them back (an event recorded on one, waited for on the
// other).  On a stream being captured, the fork makes each side stream
// join the capture, and a stream that joined a capture stays in it until
// the capture ends (cudaStreamEndCapture): whatever is enqueued there
// meanwhile is captured too, and a stream cannot be in two captures.  So
// a captured program never uses the side streams of eager calls (an eager
// call made before the capture ends would land in the graph, or fail
// with cudaErrorStreamCaptureIsolation); it takes streams of a pool of
// its own that are in no capture, or already in the caller's, which is
// how NCCL's internal streams join a user's capture too.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

namespace loom {

// `need` distinct streams of `pool` for a program captured in capture
// `capture` (nonzero: the caller stream's capture id).  captureOf(s) is
// the capture stream s is in (0: none); a stream is taken when it is in
// none or in `capture`, those already in `capture` first (they are on the
// graph's path anyway), then the pool's order; create() makes a stream
// when too few are free, appended to the pool.  Errors of captureOf and
// create are theirs (thrown).
std::vector<void*> pickCaptureStreams(std::vector<void*>& pool, uint64_t capture, int need,
                                      const std::function<uint64_t(void*)>& captureOf,
                                      const std::function<void*()>& create);

}  // namespace loom

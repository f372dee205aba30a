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
// with cudaErrorStreamCaptureIsolation); it takes streams of pools of
// their own that are in no capture, or already in the caller's, which is
// how NCCL's internal streams join a user's capture too.
//
// Each program stream index has a pool of its own, as the eager side
// streams are one per index: the collectives' stream 1 and send/recv's
// stream 2 never share a stream, in a capture either (two programs that
// the ranks may order otherwise, say on two user streams forked inside
// one capture, must not queue behind each other there).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

namespace loom {

// A stream of `pool` for a program captured in capture `capture`
// (nonzero: the caller stream's capture id).  captureOf(s) is the
// capture stream s is in (0: none); the first stream of the pool already
// in `capture` is taken (it is on the graph's path anyway), else the
// first in none, else one that create() makes, appended to the pool.
// Errors of captureOf and create are theirs (thrown).
void* pickCaptureStream(std::vector<void*>& pool, uint64_t capture, const std::function<uint64_t(void*)>& captureOf,
                        const std::function<void*()>& create);

}  // namespace loom

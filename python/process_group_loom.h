// ProcessGroupLoom: loom as a torch.distributed backend (a c10d::ProcessGroup
// on PyTorch 1.13, Debian's; a c10d::Backend on PyTorch 2.x, which wraps
// backends in its own ProcessGroup). CPU tensors only. Every operation is enqueued on one
// loom host stream per group; a completer thread waits for the stream
// (loomStreamSynchronize) and then completes the Work objects of everything
// that had been enqueued before it started waiting, in issue order.
//
// Lifetimes: a work holds the group's LoomQueue (communicator, stream,
// pending works), never the group itself, not even weakly. A c10 weak
// reference keeps the object's memory, and the thread that drops the last one
// runs its destructor: a work released on the completer thread after
// destroy_process_group would run ~ProcessGroupLoom there, which joins that
// very thread (std::system_error "Resource deadlock avoided"). The group's
// destructor is the only place that stops the completer and destroys the
// communicator.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/version.h>
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#define LOOM_TORCH_BACKEND 1  // the class is a c10d::Backend
#else
#define LOOM_TORCH_BACKEND 0  // the class is a c10d::ProcessGroup
#endif

#include "include/loom.h"

namespace loom_torch {

#if LOOM_TORCH_BACKEND
using GroupBase = c10d::Backend;
#else
using GroupBase = c10d::ProcessGroup;
#endif

class LoomQueue;

// One operation: keeps its tensors alive until loom is done with them, runs an
// optional copy-out step, then completes both the Work and its Future.
class LoomWork : public c10d::Work {
 public:
  // profilingTitle ("loom:all_reduce") names the operation's profiler event:
  // c10d::Work opens it here and closes it when the work finishes.
  LoomWork(int rank, c10d::OpType type, const char* profilingTitle, const std::vector<at::Tensor>& inputs,
           std::vector<at::Tensor> outputs, std::vector<at::Tensor> keepAlive, std::function<void()> copyOut);
  std::vector<at::Tensor> result() override { return outputs_; }
  // The three ways to wait first issue the group's held-back point-to-point
  // calls (see LoomQueue::hold).
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  bool isCompleted() override;
  // An untimed wait synchronizes the stream on the caller's thread (which
  // then runs the operation itself) instead of waiting for the completer.
  bool wait(std::chrono::milliseconds timeout) override;
  void setQueue(std::shared_ptr<LoomQueue> queue) { queue_ = std::move(queue); }
  // A receive's status (loomRecvTagged writes it when the receive completes):
  // recv from any source reports the sender through sourceRank().
  loomP2PStatus* status() { return &status_; }
  int sourceRank() const override { return status_.source; }
  // Called once, by the completer, after loom finished the operation.
  void complete(std::exception_ptr error);

 private:
  std::vector<at::Tensor> outputs_;
  std::vector<at::Tensor> keepAlive_;
  std::function<void()> copyOut_;
  loomP2PStatus status_{-1, -1, 0};
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  // The queue of the group that issued this work (see the lifetimes above).
  std::shared_ptr<LoomQueue> queue_;
};

// What a group shares with its works and its completer thread.
class LoomQueue {
 public:
  LoomQueue(loomComm_t comm, loomStream_t stream) : comm_(comm), stream_(stream) {}
  // Runs launch() (a loom call on stream()) and queues `work` for the
  // completer (or for endCoalescing while coalescing); throws with loom's
  // message if the call is refused.
  // Issues a collective (the held point-to-point calls first).
  void issue(const char* what, const c10::intrusive_ptr<LoomWork>& work,
             const std::function<loomResult_t()>& launch);
  // A send or receive called on its own (not coalescing) is held back and
  // issued later together with the others held, as one loom group, in which
  // tagged sends and receives progress together.  A stream runs its
  // operations one after another, so `irecv(from left); irecv(from right);
  // isend(to right); isend(to left)` (a halo exchange, which gloo runs) would
  // otherwise wait for ever, each receive in front of the sends its
  // neighbours wait for.  The held calls are issued at the group's next
  // collective, when a work is waited on (wait, isCompleted, getFuture),
  // when coalescing starts (they join the coalesced group), at close, and by
  // the completer kHoldMs after the first was held, so that a rank that
  // blocks elsewhere (another group, the store) still lets them progress.
  // `launch` must own what it uses.
  void hold(const char* what, const c10::intrusive_ptr<LoomWork>& work, std::function<loomResult_t()> launch);
  void issueHeld();
  static constexpr std::chrono::milliseconds kHoldMs{20};
  // Completes every work queued so far: the completer's loop body, also run
  // by LoomWork::wait on the waiting thread. Does nothing once closed.
  void drain();
  // The completer thread: drains until stop() and nothing is pending.
  void completerLoop();
  void stop();
  // Completes what is pending, then destroys the stream and the communicator.
  void close();
  void startCoalescing();
  // Issues the group; returns the last coalesced work (null when none): works
  // complete in issue order, so it completes last.
  c10::intrusive_ptr<LoomWork> endCoalescing();
  loomComm_t comm() const { return comm_; }
  loomStream_t stream() const { return stream_; }
  [[noreturn]] void fail(const char* what, loomResult_t r) const;

 private:
  void completeBatch(std::deque<c10::intrusive_ptr<LoomWork>>& batch);
  struct Held {
    const char* what;
    c10::intrusive_ptr<LoomWork> work;
    std::function<loomResult_t()> launch;
    std::chrono::steady_clock::time_point at;
  };
  using Failed = std::vector<std::pair<c10::intrusive_ptr<LoomWork>, std::exception_ptr>>;
  // Issues the held calls as one loom group (m_ held), their works to
  // `into` (pending_, or coalesced_ inside an open group); if loom refuses
  // them, their works go to *failed, to be completed once m_ is released.
  void issueHeldLocked(Failed* failed);
  static void completeFailed(Failed& failed);
  std::exception_ptr errorOf(const char* what, loomResult_t r) const;

  loomComm_t comm_;
  loomStream_t stream_;
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<c10::intrusive_ptr<LoomWork>> pending_;
  std::vector<c10::intrusive_ptr<LoomWork>> coalesced_;
  std::vector<Held> held_;  // point-to-point calls held back (hold())
  bool coalescing_ = false;
  bool stop_ = false;
  // Shared while synchronizing the stream, exclusive to destroy it.
  std::shared_mutex streamLock_;
  bool closed_ = false;
  // One synchronize at a time (completeBatch), and the error of one that
  // saw the communicator fail: every batch completed after it carries it
  // (the stream hands an error to one synchronize only, which may be
  // another thread's batch's; a failed communicator fails every later call
  // anyway).  Errors that leave the communicator healthy are not kept.
  std::mutex syncMu_;
  loomResult_t failedWith_ = loomSuccess;
};

// A 1-D CPU tensor of `numel` elements in loomMemAlloc memory (pooled)
// when it is 1 MiB or more, ordinary memory otherwise (loom_torch.empty).
at::Tensor sharedEmpty(int64_t numel, const at::TensorOptions& options);

class ProcessGroupLoom : public GroupBase {
 public:
  // Rendezvous through `store`: rank 0 makes the unique id and publishes it.
  ProcessGroupLoom(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                   std::chrono::milliseconds timeout);
  ~ProcessGroupLoom() override;

  static c10::intrusive_ptr<GroupBase> create(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                              std::chrono::milliseconds timeout);

  // A group over a communicator loomCommShrink made (see shrink()).
  struct FromShrink {};
  ProcessGroupLoom(FromShrink, loomComm_t comm, int rank, int size, std::vector<int64_t> parentRanks);

  // After a rank died: revokes this group's communicator (its pending works
  // fail at once) and builds a group of the survivors, less `exclude` (ranks
  // of this group), with loomCommShrink.  Collective over the survivors.
  // nullptr on a rank that is left out.  This group stays usable only to be
  // destroyed.
  c10::intrusive_ptr<ProcessGroupLoom> shrink(const std::vector<int64_t>& exclude);
  // For a group made by shrink(): each of its ranks' rank in the group it
  // was shrunk from; empty otherwise.
  const std::vector<int64_t>& parentRanks() const { return parentRanks_; }

  const std::string getBackendName() const override { return "loom"; }

  void startCoalescing() override;
#if LOOM_TORCH_BACKEND
  // The group's work: done when every coalesced operation is.
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
#else
  void endCoalescing(std::vector<c10::intrusive_ptr<c10d::Work>>& reqs) override;
#endif

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
#if LOOM_TORCH_BACKEND
  // torch 2.x sends sparse tensors here: reduced as allreduce does (dense form).
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override {
    return allreduce(tensors, opts);
  }
#endif
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

 private:
  c10::intrusive_ptr<c10d::Work> issue(const char* what, c10::intrusive_ptr<LoomWork> work,
                                       const std::function<loomResult_t()>& launch);
  // A send or receive: held back (LoomQueue::hold); `launch` owns what it uses.
  c10::intrusive_ptr<c10d::Work> hold(const char* what, c10::intrusive_ptr<LoomWork> work,
                                      std::function<loomResult_t()> launch);

  // The stream, the queue and the completer thread, once comm_ exists.
  void start();

  loomComm_t comm_ = nullptr;
  loomStream_t stream_ = nullptr;
  std::shared_ptr<LoomQueue> queue_;
  std::thread completer_;
  std::vector<int64_t> parentRanks_;
};

}  // namespace loom_torch

// ProcessGroupLoom: loom as a torch.distributed backend (PyTorch 1.13's
// c10d::ProcessGroup). CPU tensors only. Every operation is enqueued on one
// loom host stream per group; a completer thread waits for the stream
// (loomStreamSynchronize) and then completes the Work objects of everything
// that had been enqueued before it started waiting, in issue order.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "include/loom.h"

namespace loom_torch {

// One operation: keeps its tensors alive until loom is done with them, runs an
// optional copy-out step, then completes both the Work and its Future.
class LoomWork : public c10d::Work {
 public:
  LoomWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, std::vector<at::Tensor> keepAlive,
           std::function<void()> copyOut);
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  // An untimed wait synchronizes the stream on the caller's thread (which
  // then runs the operation itself) instead of waiting for the completer.
  bool wait(std::chrono::milliseconds timeout) override;
  void setGroup(c10::weak_intrusive_ptr<c10d::ProcessGroup> group) { group_ = std::move(group); }
  // Called once, by the completer, after loom finished the operation.
  void complete(std::exception_ptr error);

 private:
  std::vector<at::Tensor> outputs_;
  std::vector<at::Tensor> keepAlive_;
  std::function<void()> copyOut_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  // The ProcessGroupLoom that issued this work (weak: a work may outlive it).
  c10::weak_intrusive_ptr<c10d::ProcessGroup> group_{c10::intrusive_ptr<c10d::ProcessGroup>()};
};

class ProcessGroupLoom : public c10d::ProcessGroup {
 public:
  // Rendezvous through `store`: rank 0 makes the unique id and publishes it.
  ProcessGroupLoom(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                   std::chrono::milliseconds timeout);
  ~ProcessGroupLoom() override;

  static c10::intrusive_ptr<c10d::ProcessGroup> create(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                       int size, std::chrono::milliseconds timeout);

  const std::string getBackendName() const override { return "loom"; }

  void startCoalescing() override;
  void endCoalescing(std::vector<c10::intrusive_ptr<c10d::Work>>& reqs) override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
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
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;

  // Completes every work queued so far: the completer's loop body, also run
  // by LoomWork::wait on the waiting thread.
  void drain();

 private:
  // Calls launch() (a loom call on stream_) and queues `work` for the
  // completer; throws with loom's message if the call is refused.
  c10::intrusive_ptr<c10d::Work> issue(const char* what, c10::intrusive_ptr<LoomWork> work,
                                       const std::function<loomResult_t()>& launch);
  void completerLoop();
  void completeBatch(std::deque<c10::intrusive_ptr<LoomWork>>& batch);
  [[noreturn]] void fail(const char* what, loomResult_t r) const;

  loomComm_t comm_ = nullptr;
  loomStream_t stream_ = nullptr;
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<c10::intrusive_ptr<LoomWork>> pending_;
  std::vector<c10::intrusive_ptr<LoomWork>> coalesced_;
  bool coalescing_ = false;
  bool stop_ = false;
  std::thread completer_;
};

}  // namespace loom_torch

#include "python/process_group_loom.h"

#include <string>

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

namespace loom_torch {
namespace {

const char kUniqueIdKey[] = "loom_unique_id";

// torch dtype -> loom datatype. bool travels as uint8 (see redOpFor).
loomDataType_t dtypeFor(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kChar: return loomInt8;
    case at::kByte: return loomUint8;
    case at::kBool: return loomUint8;
    case at::kInt: return loomInt32;
    case at::kLong: return loomInt64;
    case at::kHalf: return loomFloat16;
    case at::kBFloat16: return loomBfloat16;
    case at::kFloat: return loomFloat32;
    case at::kDouble: return loomFloat64;
    default:
      TORCH_CHECK(false, "loom backend: dtype ", t.scalar_type(),
                  " is not supported (supported: int8, uint8, bool, int32, int64, float16, bfloat16, float32, "
                  "float64)");
  }
}

// torch reduce op -> loom op. As NCCL does for bool: sum is logical or (max),
// product is logical and (min).
loomRedOp_t redOpFor(const c10d::ReduceOp& op, const at::Tensor& t) {
  bool isBool = t.scalar_type() == at::kBool;
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return isBool ? loomMax : loomSum;
    case c10d::ReduceOp::PRODUCT: return isBool ? loomMin : loomProd;
    case c10d::ReduceOp::MIN: return loomMin;
    case c10d::ReduceOp::MAX: return loomMax;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK(!isBool, "loom backend: ReduceOp.AVG is not defined for bool tensors");
      return loomAvg;
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR:
      TORCH_CHECK(false, "loom backend: bitwise reductions (BAND, BOR, BXOR) are not supported "
                  "(supported: SUM, AVG, PRODUCT, MIN, MAX)");
    default:
      TORCH_CHECK(false, "loom backend: reduce op ", int(op.op_),
                  " is not supported (supported: SUM, AVG, PRODUCT, MIN, MAX)");
  }
}

void checkTensor(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.defined(), "loom backend: ", what, ": undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), "loom backend: ", what, ": only CPU tensors are supported, got a tensor on ",
              t.device());
  TORCH_CHECK(t.layout() == at::kStrided, "loom backend: ", what, ": only dense (strided) tensors are supported");
  TORCH_CHECK(t.is_contiguous(), "loom backend: ", what,
              ": the tensor must be contiguous (pass tensor.contiguous() and copy back)");
  dtypeFor(t);
}

const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* what) {
  TORCH_CHECK(tensors.size() == 1, "loom backend: ", what, " takes exactly one tensor per rank, got ",
              tensors.size());
  checkTensor(tensors[0], what);
  return tensors[0];
}

void checkSameKind(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "loom backend: ", what, ": tensors have different dtypes (",
              a.scalar_type(), " and ", b.scalar_type(), ")");
}

// One contiguous tensor holding `parts` back to back.
at::Tensor flatten(const std::vector<at::Tensor>& parts) {
  std::vector<at::Tensor> flat;
  flat.reserve(parts.size());
  for (const at::Tensor& p : parts) flat.push_back(p.reshape({-1}));
  return at::cat(flat);
}

}  // namespace

LoomWork::LoomWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, std::vector<at::Tensor> keepAlive,
                   std::function<void()> copyOut)
    : c10d::Work(rank, type),
      outputs_(std::move(outputs)),
      keepAlive_(std::move(keepAlive)),
      copyOut_(std::move(copyOut)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

bool LoomWork::wait(std::chrono::milliseconds timeout) {
  if (timeout == kNoTimeout && !isCompleted()) {
    if (c10::intrusive_ptr<c10d::ProcessGroup> group = group_.lock())
      static_cast<ProcessGroupLoom*>(group.get())->drain();
  }
  return c10d::Work::wait(timeout);
}

void LoomWork::complete(std::exception_ptr error) {
  if (!error && copyOut_) {
    try {
      copyOut_();
    } catch (...) {
      error = std::current_exception();
    }
  }
  copyOut_ = nullptr;
  keepAlive_.clear();
  finish(error);
  if (error) future_->setError(error);
  else future_->markCompleted(c10::IValue(outputs_));
}

ProcessGroupLoom::ProcessGroupLoom(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                   std::chrono::milliseconds timeout)
    : c10d::ProcessGroup(rank, size) {
  loomUniqueId id;
  if (rank == 0) {
    loomResult_t r = loomGetUniqueId(&id);
    if (r != loomSuccess) fail("loomGetUniqueId", r);
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(id.internal);
    store->set(kUniqueIdKey, std::vector<uint8_t>(bytes, bytes + sizeof id.internal));
  } else {
    store->wait({kUniqueIdKey}, timeout);
    std::vector<uint8_t> bytes = store->get(kUniqueIdKey);
    TORCH_CHECK(bytes.size() == sizeof id.internal, "loom backend: the unique id in the store has ", bytes.size(),
                " bytes, expected ", sizeof id.internal);
    memcpy(id.internal, bytes.data(), sizeof id.internal);
  }
  loomResult_t r = loomCommInitRank(&comm_, size, id, rank);
  if (r != loomSuccess) fail("loomCommInitRank", r);
  r = loomStreamCreate(&stream_);
  if (r != loomSuccess) {
    loomCommAbort(comm_);
    fail("loomStreamCreate", r);
  }
  completer_ = std::thread([this] { completerLoop(); });
  init();
}

ProcessGroupLoom::~ProcessGroupLoom() {
  {
    std::lock_guard<std::mutex> lock(m_);
    stop_ = true;
  }
  cv_.notify_all();
  completer_.join();
  loomStreamDestroy(stream_);
  loomCommDestroy(comm_);
}

c10::intrusive_ptr<c10d::ProcessGroup> ProcessGroupLoom::create(const c10::intrusive_ptr<c10d::Store>& store,
                                                                int rank, int size,
                                                                std::chrono::milliseconds timeout) {
  return c10::make_intrusive<ProcessGroupLoom>(store, rank, size, timeout);
}

void ProcessGroupLoom::fail(const char* what, loomResult_t r) const {
  std::string detail = loomGetLastError(comm_);
  if (detail.empty()) detail = loomGetLastError(nullptr);
  TORCH_CHECK(false, "loom backend: ", what, " failed: ", loomGetErrorString(r),
              detail.empty() ? "" : ": ", detail);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::issue(const char* what, c10::intrusive_ptr<LoomWork> work,
                                                       const std::function<loomResult_t()>& launch) {
  work->setGroup(c10::weak_intrusive_ptr<c10d::ProcessGroup>(
      c10::intrusive_ptr<c10d::ProcessGroup>::unsafe_reclaim_from_nonowning(this)));
  std::lock_guard<std::mutex> lock(m_);
  loomResult_t r = launch();
  if (r != loomSuccess) fail(what, r);
  if (coalescing_) {
    coalesced_.push_back(work);
  } else {
    pending_.push_back(work);
    cv_.notify_one();
  }
  return work;
}

// Everything in `batch` was enqueued on the stream before the synchronize
// started, so it is complete when the synchronize returns. The stream reports
// the first error since the last synchronize; the whole batch carries it (a
// failed communicator fails every later call anyway). Several threads may
// synchronize at once: each completes the batch it took.
void ProcessGroupLoom::completeBatch(std::deque<c10::intrusive_ptr<LoomWork>>& batch) {
  loomResult_t r = loomStreamSynchronize(stream_);
  std::exception_ptr error;
  if (r != loomSuccess) {
    try {
      fail("operation", r);
    } catch (...) {
      error = std::current_exception();
    }
  }
  for (auto& w : batch) w->complete(error);
}

void ProcessGroupLoom::drain() {
  std::deque<c10::intrusive_ptr<LoomWork>> batch;
  {
    std::lock_guard<std::mutex> lock(m_);
    batch.swap(pending_);
  }
  completeBatch(batch);
}

void ProcessGroupLoom::completerLoop() {
  for (;;) {
    std::deque<c10::intrusive_ptr<LoomWork>> batch;
    {
      std::unique_lock<std::mutex> lock(m_);
      cv_.wait(lock, [&] { return stop_ || !pending_.empty(); });
      if (pending_.empty()) return;
      batch.swap(pending_);
    }
    completeBatch(batch);
  }
}

void ProcessGroupLoom::startCoalescing() {
  std::lock_guard<std::mutex> lock(m_);
  TORCH_CHECK(!coalescing_, "loom backend: coalescing is already on");
  loomResult_t r = loomGroupStart();
  if (r != loomSuccess) fail("loomGroupStart", r);
  coalescing_ = true;
}

void ProcessGroupLoom::endCoalescing(std::vector<c10::intrusive_ptr<c10d::Work>>& /*reqs*/) {
  std::lock_guard<std::mutex> lock(m_);
  TORCH_CHECK(coalescing_, "loom backend: endCoalescing without startCoalescing");
  coalescing_ = false;
  std::vector<c10::intrusive_ptr<LoomWork>> works;
  works.swap(coalesced_);
  loomResult_t r = loomGroupEnd();
  if (r != loomSuccess) {
    std::exception_ptr error;
    try {
      fail("loomGroupEnd", r);
    } catch (...) {
      error = std::current_exception();
    }
    for (auto& w : works) w->complete(error);
    std::rethrow_exception(error);
  }
  for (auto& w : works) pending_.push_back(w);
  cv_.notify_one();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions& opts) {
  at::Tensor t = single(tensors, "broadcast");
  TORCH_CHECK(opts.rootTensor == 0, "loom backend: broadcast: rootTensor must be 0");
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "loom backend: broadcast: root ", opts.rootRank,
              " is not a rank of this group of ", size_);
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::BROADCAST, tensors, tensors, nullptr);
  return issue("loomBroadcast", w, [&] {
    return loomBroadcast(t.data_ptr(), t.data_ptr(), size_t(t.numel()), dtypeFor(t), int(opts.rootRank), comm_,
                         stream_);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  at::Tensor t = single(tensors, "allreduce");
  loomRedOp_t op = redOpFor(opts.reduceOp, t);
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::ALLREDUCE, tensors, tensors, nullptr);
  return issue("loomAllReduce", w, [&] {
    return loomAllReduce(t.data_ptr(), t.data_ptr(), size_t(t.numel()), dtypeFor(t), op, comm_, stream_);
  });
}

// One all-reduce over the tensors concatenated, then copied back.
c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                     const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "loom backend: allreduce_coalesced: no tensors");
  for (const at::Tensor& t : tensors) {
    checkTensor(t, "allreduce_coalesced");
    checkSameKind(tensors[0], t, "allreduce_coalesced");
  }
  loomRedOp_t op = redOpFor(opts.reduceOp, tensors[0]);
  at::Tensor flat = flatten(tensors);
  std::vector<at::Tensor> outs = tensors;
  auto copyOut = [flat, outs]() mutable {
    int64_t off = 0;
    for (at::Tensor& o : outs) {
      o.view({-1}).copy_(flat.narrow(0, off, o.numel()));
      off += o.numel();
    }
  };
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::ALLREDUCE_COALESCED, tensors,
                                         std::vector<at::Tensor>{flat}, copyOut);
  return issue("loomAllReduce", w, [&] {
    return loomAllReduce(flat.data_ptr(), flat.data_ptr(), size_t(flat.numel()), dtypeFor(flat), op, comm_,
                         stream_);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::reduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::ReduceOptions& opts) {
  at::Tensor t = single(tensors, "reduce");
  TORCH_CHECK(opts.rootTensor == 0, "loom backend: reduce: rootTensor must be 0");
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "loom backend: reduce: root ", opts.rootRank,
              " is not a rank of this group of ", size_);
  loomRedOp_t op = redOpFor(opts.reduceOp, t);
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::REDUCE, tensors, tensors, nullptr);
  return issue("loomReduce", w, [&] {
    return loomReduce(t.data_ptr(), t.data_ptr(), size_t(t.numel()), dtypeFor(t), op, int(opts.rootRank), comm_,
                      stream_);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions& /*opts*/) {
  at::Tensor in = single(inputs, "allgather");
  TORCH_CHECK(outputs.size() == 1, "loom backend: allgather takes one output list per rank, got ", outputs.size());
  std::vector<at::Tensor> outs = outputs[0];
  TORCH_CHECK(int(outs.size()) == size_, "loom backend: allgather: the output list has ", outs.size(),
              " tensors, expected the group size ", size_);
  for (const at::Tensor& o : outs) {
    TORCH_CHECK(o.defined() && o.device().is_cpu(), "loom backend: allgather: outputs must be CPU tensors");
    checkSameKind(in, o, "allgather");
    TORCH_CHECK(o.numel() == in.numel(), "loom backend: allgather: an output has ", o.numel(),
                " elements, the input ", in.numel());
  }
  at::Tensor flat = at::empty({int64_t(size_) * in.numel()}, in.options());
  auto copyOut = [flat, outs]() mutable {
    for (size_t i = 0; i < outs.size(); ++i)
      outs[i].copy_(flat.narrow(0, int64_t(i) * outs[i].numel(), outs[i].numel()).view(outs[i].sizes()));
  };
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::ALLGATHER, outs, std::vector<at::Tensor>{in, flat},
                                         copyOut);
  return issue("loomAllGather", w, [&] {
    return loomAllGather(in.data_ptr(), flat.data_ptr(), size_t(in.numel()), dtypeFor(in), comm_, stream_);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::AllgatherOptions& /*opts*/) {
  checkTensor(input, "all_gather_into_tensor");
  checkTensor(output, "all_gather_into_tensor");
  checkSameKind(input, output, "all_gather_into_tensor");
  TORCH_CHECK(output.numel() == int64_t(size_) * input.numel(), "loom backend: all_gather_into_tensor: the output has ",
              output.numel(), " elements, expected group size x input = ", int64_t(size_) * input.numel());
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::_ALLGATHER_BASE, std::vector<at::Tensor>{output},
                                         std::vector<at::Tensor>{input, output}, nullptr);
  return issue("loomAllGather", w, [&] {
    return loomAllGather(input.data_ptr(), output.data_ptr(), size_t(input.numel()), dtypeFor(input), comm_,
                         stream_);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                                const c10d::ReduceScatterOptions& opts) {
  at::Tensor out = single(outputs, "reduce_scatter");
  TORCH_CHECK(inputs.size() == 1, "loom backend: reduce_scatter takes one input list per rank, got ", inputs.size());
  const std::vector<at::Tensor>& ins = inputs[0];
  TORCH_CHECK(int(ins.size()) == size_, "loom backend: reduce_scatter: the input list has ", ins.size(),
              " tensors, expected the group size ", size_);
  for (const at::Tensor& i : ins) {
    TORCH_CHECK(i.defined() && i.device().is_cpu(), "loom backend: reduce_scatter: inputs must be CPU tensors");
    checkSameKind(out, i, "reduce_scatter");
    TORCH_CHECK(i.numel() == out.numel(), "loom backend: reduce_scatter: an input has ", i.numel(),
                " elements, the output ", out.numel());
  }
  loomRedOp_t op = redOpFor(opts.reduceOp, out);
  at::Tensor flat = flatten(ins);
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::REDUCE_SCATTER, outputs,
                                         std::vector<at::Tensor>{flat, out}, nullptr);
  return issue("loomReduceScatter", w, [&] {
    return loomReduceScatter(flat.data_ptr(), out.data_ptr(), size_t(out.numel()), dtypeFor(out), op, comm_,
                             stream_);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                      const c10d::ReduceScatterOptions& opts) {
  checkTensor(input, "reduce_scatter_tensor");
  checkTensor(output, "reduce_scatter_tensor");
  checkSameKind(input, output, "reduce_scatter_tensor");
  TORCH_CHECK(input.numel() == int64_t(size_) * output.numel(), "loom backend: reduce_scatter_tensor: the input has ",
              input.numel(), " elements, expected group size x output = ", int64_t(size_) * output.numel());
  loomRedOp_t op = redOpFor(opts.reduceOp, output);
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::_REDUCE_SCATTER_BASE, std::vector<at::Tensor>{output},
                                         std::vector<at::Tensor>{input, output}, nullptr);
  return issue("loomReduceScatter", w, [&] {
    return loomReduceScatter(input.data_ptr(), output.data_ptr(), size_t(output.numel()), dtypeFor(output), op,
                             comm_, stream_);
  });
}

// A one-byte all-reduce: returns on every rank only once all have entered.
c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::barrier(const c10d::BarrierOptions& /*opts*/) {
  at::Tensor token = at::zeros({1}, at::TensorOptions().dtype(at::kByte));
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::BARRIER, std::vector<at::Tensor>{},
                                         std::vector<at::Tensor>{token}, nullptr);
  return issue("loomAllReduce (barrier)", w, [&] {
    return loomAllReduce(token.data_ptr(), token.data_ptr(), 1, loomUint8, loomMax, comm_, stream_);
  });
}

// loom matches the sends and recvs of a pair in issue order; it has no tags.
c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  at::Tensor t = single(tensors, "send");
  TORCH_CHECK(tag == 0, "loom backend: send: tags are not supported (messages between two ranks match in order); "
              "got tag ", tag);
  TORCH_CHECK(dstRank >= 0 && dstRank < size_ && dstRank != rank_, "loom backend: send: bad destination rank ",
              dstRank);
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::SEND, std::vector<at::Tensor>{}, tensors, nullptr);
  return issue("loomSend", w, [&] {
    return loomSend(t.data_ptr(), size_t(t.numel()), dtypeFor(t), dstRank, comm_, stream_);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  at::Tensor t = single(tensors, "recv");
  TORCH_CHECK(tag == 0, "loom backend: recv: tags are not supported (messages between two ranks match in order); "
              "got tag ", tag);
  TORCH_CHECK(srcRank >= 0 && srcRank < size_ && srcRank != rank_, "loom backend: recv: bad source rank ", srcRank);
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::RECV, tensors, tensors, nullptr);
  return issue("loomRecv", w, [&] {
    return loomRecv(t.data_ptr(), size_t(t.numel()), dtypeFor(t), srcRank, comm_, stream_);
  });
}

}  // namespace loom_torch

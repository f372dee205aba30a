#include "algorithms/schedule.h"

#include <iterator>

#include "src/core/error.h"

namespace loom {

const char* collectiveName(Collective c) {
  switch (c) {
    case Collective::AllReduce: return "AllReduce";
    case Collective::ReduceScatter: return "ReduceScatter";
    case Collective::AllGather: return "AllGather";
    case Collective::Broadcast: return "Broadcast";
    case Collective::Reduce: return "Reduce";
    case Collective::P2P: return "Send/Recv";
    case Collective::AllToAll: return "AllToAll";
    case Collective::Gather: return "Gather";
    case Collective::Scatter: return "Scatter";
  }
  return "?";
}

const char* stepKindName(StepKind k) {
  switch (k) {
    case StepKind::Send: return "send";
    case StepKind::Recv: return "recv";
    case StepKind::RecvReduce: return "recvReduce";
    case StepKind::RecvReduceSend: return "recvReduceSend";
    case StepKind::RecvCopySend: return "recvCopySend";
    case StepKind::Copy: return "copy";
    case StepKind::Handshake: return "handshake";
  }
  return "?";
}

Step makeStep(StepKind kind, int recvPeer, int sendPeer, BufRef src, BufRef dst, size_t bytes, bool finalize) {
  Step s;
  s.kind = kind;
  s.recvPeer = recvPeer;
  s.sendPeer = sendPeer;
  s.src = src;
  s.dst = dst;
  s.bytes = bytes;
  s.finalize = finalize;
  return s;
}

void addRootCheck(int opIndex, int rank, int nranks, Schedule* out) {
  if (nranks < 2) return;
  for (bool send : {true, false}) {
    Lane lane;
    lane.op = opIndex;
    int peer = (rank + (send ? 1 : nranks - 1)) % nranks;
    lane.steps.push_back(makeStep(StepKind::Handshake, send ? -1 : peer, send ? peer : -1, BufRef{}, BufRef{},
                                  kHandshakeBytes));
    out->lanes.push_back(std::move(lane));
  }
}

void prependLanes(Schedule* s, std::vector<Lane> front) {
  const int shift = int(front.size());
  for (Lane& l : s->lanes)
    for (int& a : l.after) a += shift;
  s->lanes.insert(s->lanes.begin(), std::make_move_iterator(front.begin()), std::make_move_iterator(front.end()));
}

size_t partBegin(size_t total, int parts, int i) {
  size_t base = total / size_t(parts), rem = total % size_t(parts);
  return size_t(i) * base + (size_t(i) < rem ? size_t(i) : rem);
}

static std::string ref(const BufRef& r) {
  if (r.buf == Buf::None) return "-";
  const char* name = r.buf == Buf::Send ? "send" : r.buf == Buf::Recv ? "recv" : "scratch";
  return strf("%s+%zu", name, r.offset);
}

std::string describe(const Schedule& s) {
  std::string out;
  for (size_t l = 0; l < s.lanes.size(); ++l) {
    const Lane& lane = s.lanes[l];
    out += strf("lane %zu (op %d, channel %d", l, lane.op, lane.channel);
    for (size_t i = 0; i < lane.after.size(); ++i) out += strf("%s%d", i ? ", " : ", after ", lane.after[i]);
    out += "):\n";
    for (const Step& st : lane.steps)
      out += strf("  %-14s from %2d to %2d src %-12s dst %-12s %zu B%s\n", stepKindName(st.kind),
                  st.recvPeer, st.sendPeer, ref(st.src).c_str(), ref(st.dst).c_str(), st.bytes,
                  st.finalize ? " finalize" : "");
  }
  return out;
}

}  // namespace loom

// Double binary tree all-reduce and broadcast (Sanders, Speck & Träff,
// "Two-tree algorithms for full bandwidth broadcast, reduction and scan",
// Parallel Computing 2009; tree 0 is the binary tree of NCCL's trees.cc).
//
// Ranks are relabelled to positions p = (rank - root) mod N (all-reduce:
// root 0).  Position 0 sits on top of both trees with one child each; the
// other N-1 positions form two binary trees.  Tree 0 is in-order: position
// p with lowest set bit b has parent (p^b)|2b (p^b if that is >= N) and
// children p-b/2 and p+b/2 (the right one halved while past the end), so
// odd positions are its leaves.  Tree 1 is tree 0 with positions 1..N-1
// mirrored (p -> N-p, N odd) or shifted (p -> p%(N-1)+1, N even): the
// leaves of one tree are interior nodes of the other (N even: position 1
// is a leaf of both).  N = 8:
//
//   tree 0:  0                  tree 1:  0
//            |                           |
//            4                           5      tree 1 is tree 0 with
//          /   \                       /   \    positions 1..7 shifted
//         2     6                     3     7   by one: 1 -> 2, 2 -> 3,
//        / \   / \                   / \   / \  ..., 7 -> 1
//       1   3 5   7                 2   4 6   1
//
// NCCL instead mirrors the whole tree, giving tree 1 another root; a rooted
// collective needs both trees under its root, and all-reduce loses nothing
// by sharing one (the root's link carries S/2 per tree, like any other).
//
// Tree t carries half t of the data (tree 0 the first count/2 elements),
// cut into chunks of plan.chunkBytes; its lanes use channel t, so the trees
// run concurrently (plan.channels is not used: the trees are the channels).
// All-reduce has two lanes per tree and rank, which the executor runs
// concurrently because they use opposite directions of every connection:
//   up:   leaf: send(my chunk -> parent); one child c: recvReduceSend(c ->
//         parent); two children: recvReduce(c1 -> recv chunk), then
//         recvReduceSend(c2 -> parent) from it.  The root fuses the turn:
//         recvReduceSend(child -> child, dst recv, finalize), so each slot is
//         reduced, finalized (avg) once and sent back down as it arrives.
//   down: recvCopySend(parent -> c1, dst recv chunk), then send(-> c2);
//         leaf: recv(parent -> recv chunk).
// One or two steps per chunk and lane.  No deadlock with any slot count:
// down lanes wait only for their parents and leaves always drain; up lanes
// wait only for their children and for the parent to consume, which the
// root always does.  A partial sum kept in the recv buffer is overwritten
// by the down lane slot by slot, each slot after it went up (its result
// comes back through the root).  Broadcast is the down lane alone, the root
// sending from its send buffer.
//
// Bytes sent per rank for S bytes: all-reduce 2S at most (S/2 up in each
// tree, S/2 down to each child in the one tree where it has children; 2(N-1)S
// in all, as the ring), broadcast S at most ((N-1)S in all).  The trees are
// ceil(log2 N)+1 deep, so a chunk's round trip takes O(log N) steps where the
// ring takes 2(N-1).
//
// Reduce is the up lanes alone, rooted at op.root: an interior rank holds
// the partial sum of its first child in one chunk of scratch per tree
// (loomReduce gives non-root ranks no buffer) and the root reduces into recv;
// S bytes at most per rank, depth log2 N.  Reduce-scatter, all-gather and
// N = 1 go to the ring's schedules.
#include <algorithm>

#include "algorithms/algorithms.h"
#include "src/device/host_reduce.h"

namespace loom {

namespace {

struct TreeNode {
  int parent = -1;
  int child[2] = {-1, -1};
};

// NCCL's binary tree over positions 0..n-1.
TreeNode binaryTree(int p, int n) {
  TreeNode t;
  int bit = 1;
  while (bit < n && !(p & bit)) bit <<= 1;
  if (p == 0) {
    t.child[0] = bit >> 1;
    return t;
  }
  t.parent = (p ^ bit) | (bit << 1);
  if (t.parent >= n) t.parent = p ^ bit;
  int low = bit >> 1;
  if (low == 0) return t;
  t.child[0] = p - low;
  while (low && p + low >= n) low >>= 1;
  if (low) t.child[1] = p + low;
  return t;
}

// Tree 1's relabelling of positions 1..n-1 (0 stays on top).
int tree1Pos(int p, int n, bool inverse) {
  if (p == 0) return 0;
  if (n % 2) return n - p;
  return inverse ? (p + n - 3) % (n - 1) + 1 : p % (n - 1) + 1;
}

// Parent and children of `rank` in tree `t`, as ranks.
TreeNode treeNode(int t, int rank, int root, int n) {
  int p = (rank - root + n) % n;
  TreeNode node = binaryTree(t ? tree1Pos(p, n, true) : p, n);
  auto toRank = [&](int q) { return q < 0 ? -1 : ((t ? tree1Pos(q, n, false) : q) + root) % n; };
  node.parent = toRank(node.parent);
  for (int& c : node.child) c = toRank(c);
  return node;
}


}  // namespace

void doubleBinaryTreeSchedule(const OpDesc& op, int opIndex, int rank, int nranks, const Plan& plan,
                              Schedule* out) {
  const bool allReduce = op.coll == Collective::AllReduce;
  const bool reduce = op.coll == Collective::Reduce;
  if (nranks == 1 || (!allReduce && !reduce && op.coll != Collective::Broadcast)) {
    ringSchedule(op, opIndex, rank, nranks, plan, out);
    return;
  }
  const size_t esz = dtypeSize(op.dtype);
  const size_t chunkElems = std::max<size_t>(1, plan.chunkBytes / esz);
  const int root = allReduce ? 0 : op.root;
  const BufRef none;
  // Reduce: an interior rank with two children keeps the first child's sum
  // for one chunk in scratch (t x chunk bytes in): recv may be NULL off the root.
  if (reduce) out->needScratch(opIndex, 2 * chunkElems * esz);
  for (int t = 0; t < 2; ++t) {
    const size_t begin = t ? op.count / 2 : 0, end = t ? op.count : op.count / 2;
    if (begin == end) continue;
    const TreeNode node = treeNode(t, rank, root, nranks);
    const int p = node.parent, c1 = node.child[0], c2 = node.child[1];
    Lane up, down;
    up.op = down.op = opIndex;
    up.channel = down.channel = t;
    for (size_t o = begin; o < end; o += chunkElems) {
      const size_t bytes = std::min(chunkElems, end - o) * esz;
      const BufRef S{Buf::Send, o * esz}, R{Buf::Recv, o * esz};
      if (p < 0) {
        if (allReduce)
          up.steps.push_back(makeStep(StepKind::RecvReduceSend, c1, c1, S, R, bytes, true));
        else if (reduce)
          up.steps.push_back(makeStep(StepKind::RecvReduce, c1, -1, S, R, bytes, true));
        else
          down.steps.push_back(makeStep(StepKind::Send, -1, c1, S, none, bytes));
        continue;
      }
      if (reduce) {
        const BufRef X{Buf::Scratch, size_t(t) * chunkElems * esz};
        if (c2 >= 0) {
          up.steps.push_back(makeStep(StepKind::RecvReduce, c1, -1, S, X, bytes));
          up.steps.push_back(makeStep(StepKind::RecvReduceSend, c2, p, X, none, bytes));
        } else if (c1 >= 0) {
          up.steps.push_back(makeStep(StepKind::RecvReduceSend, c1, p, S, none, bytes));
        } else {
          up.steps.push_back(makeStep(StepKind::Send, -1, p, S, none, bytes));
        }
        continue;
      }
      if (allReduce) {
        if (c2 >= 0) {
          up.steps.push_back(makeStep(StepKind::RecvReduce, c1, -1, S, R, bytes));
          up.steps.push_back(makeStep(StepKind::RecvReduceSend, c2, p, R, none, bytes));
        } else if (c1 >= 0) {
          up.steps.push_back(makeStep(StepKind::RecvReduceSend, c1, p, S, none, bytes));
        } else {
          up.steps.push_back(makeStep(StepKind::Send, -1, p, S, none, bytes));
        }
      }
      if (c1 < 0) {
        down.steps.push_back(makeStep(StepKind::Recv, p, -1, none, R, bytes));
        continue;
      }
      down.steps.push_back(makeStep(StepKind::RecvCopySend, p, c1, none, R, bytes));
      if (c2 >= 0) down.steps.push_back(makeStep(StepKind::Send, -1, c2, R, none, bytes));
    }
    if (p < 0 && op.coll == Collective::Broadcast && op.sendbuf != op.recvbuf)
      down.steps.push_back(makeStep(StepKind::Copy, -1, -1, BufRef{Buf::Send, begin * esz},
                                BufRef{Buf::Recv, begin * esz}, (end - begin) * esz));
    for (Lane* l : {&up, &down})
      if (!l->steps.empty()) out->lanes.push_back(std::move(*l));
  }
}

// Cost (src/tuner/cost_model.h): depth log2 N up and down, pipelined in
// chunks; an interior rank sends S/2 up each tree and S/2 down to each of its
// two children in one tree: 2S (broadcast: S).
void doubleBinaryTreeEstimate(const CostInput& in, std::vector<Estimate>* out) {
  const double S = in.S;
  auto add = [&](double us) { out->push_back(Estimate{Algorithm::Tree, Algorithm::Ring, us, ""}); };
  if (in.N == 1) {
    out->push_back(Estimate{Algorithm::Tree, Algorithm::Ring, -1, "one rank: the ring's copy"});
    return;
  }
  double aa, ab;
  in.anyPair(&aa, &ab);
  double depth = log2ceil(in.N) + 1;
  if (in.coll == Collective::AllReduce)
    add((2 * depth + in.loops(S / 2, 1)) * aa + xfer(2 * S, ab) + in.reduce(S));
  else if (in.coll == Collective::Broadcast)
    add((depth + in.loops(S / 2, 1)) * aa + xfer(S, ab));
  else
    add((depth + in.loops(S / 2, 1)) * aa + xfer(S, ab) + in.reduce(S));
}

// As the rails' all-reduce: depth log2 H + 1 up and down, 2S over a host's link.
StepsAndBytesUs doubleBinaryTreeRailCost(const CostInput& in, const RailCost& r) {
  double lgH = log2ceil(in.H);
  return {(2 * (lgH + 1) + in.loops(r.rail / 2, 1)) * r.na, xfer(2 * r.S, r.nb)};
}

}  // namespace loom

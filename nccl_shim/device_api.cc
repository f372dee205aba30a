// The host side of NCCL's device API (nccl_device.h): device communicators,
// barriers and LL all-to-all resources live in CUDA kernels, which loom does
// not launch, so the calls that make them return ncclInvalidUsage.  The team
// queries are arithmetic and answer for a communicator whose load-store team
// is the rank alone (loom gives no peer load/store access through its API).
// nccl_device.h needs what nccl.h includes (size_t) first.
// clang-format off
#include "nccl_shim/shim.h"
#include <nccl_device.h>
// clang-format on

using namespace nccl_shim;

namespace {

ncclResult_t noDeviceApi(const char* call) {
  ensureEnv();
  return fail(
      ncclInvalidUsage,
      "%s: NCCL's device API (the caller's kernels communicating through NCCL) is not implemented: loom's "
      "CUDA communicators run their own stream programs, not user kernels",
      call);
}

}  // namespace

NCCL_SHIM_API(ncclResult_t, ncclDevCommCreate, ncclComm_t comm, ncclDevCommRequirements_t const* reqs,
              ncclDevComm_t* outDevComm) {
  (void)comm, (void)reqs, (void)outDevComm;
  return noDeviceApi("ncclDevCommCreate");
}

NCCL_SHIM_API(ncclResult_t, ncclDevCommDestroy, ncclComm_t comm, ncclDevComm_t const* devComm) {
  (void)comm, (void)devComm;
  return noDeviceApi("ncclDevCommDestroy");
}

NCCL_SHIM_API(ncclResult_t, ncclLsaBarrierCreateRequirement, ncclTeam_t team, int nBarriers,
              ncclLsaBarrierHandle_t* outHandle, ncclDevResourceRequirements_t* outReq) {
  (void)team, (void)nBarriers, (void)outHandle, (void)outReq;
  return noDeviceApi("ncclLsaBarrierCreateRequirement");
}

NCCL_SHIM_API(ncclResult_t, ncclGinBarrierCreateRequirement, ncclComm_t comm, ncclTeam_t team, int nBarriers,
              ncclGinBarrierHandle_t* outHandle, ncclDevResourceRequirements_t* outReq) {
  (void)comm, (void)team, (void)nBarriers, (void)outHandle, (void)outReq;
  return noDeviceApi("ncclGinBarrierCreateRequirement");
}

NCCL_SHIM_API(ncclResult_t, ncclLLA2ACreateRequirement, int nBlocks, int nSlots, ncclLLA2AHandle_t* outHandle,
              ncclDevResourceRequirements_t* outReq) {
  (void)nBlocks, (void)nSlots, (void)outHandle, (void)outReq;
  return noDeviceApi("ncclLLA2ACreateRequirement");
}

// No error channel: 0 slots, and ncclGetLastError says why.
NCCL_SHIM_API(int, ncclLLA2ACalcSlots, int maxElts, int maxEltSize) {
  (void)maxElts, (void)maxEltSize;
  noDeviceApi("ncclLLA2ACalcSlots");
  return 0;
}

NCCL_SHIM_API(ncclTeam_t, ncclTeamWorld, ncclComm_t comm) {
  ncclTeam_t t{comm ? comm->nranks : 0, comm ? comm->rank : 0, 1};
  return t;
}

NCCL_SHIM_API(ncclTeam_t, ncclTeamLsa, ncclComm_t comm) {
  (void)comm;
  ncclTeam_t t{1, 0, 1};
  return t;
}

// The outer factor of the load-store team: with a team of one, the world.
NCCL_SHIM_API(ncclTeam_t, ncclTeamRail, ncclComm_t comm) { return pncclTeamWorld(comm); }

NCCL_SHIM_API(int, ncclTeamRankToWorld, ncclComm_t comm, ncclTeam_t team, int rank) {
  return (comm ? comm->rank : 0) + (rank - team.rank) * team.stride;
}

NCCL_SHIM_API(int, ncclTeamRankToLsa, ncclComm_t comm, ncclTeam_t team, int rank) {
  (void)comm;
  return 0 + (rank - team.rank) * team.stride;  // this rank's index in its load-store team is 0
}

// loomCommDump and LOOM_DUMP_SIGNAL: the live communicators of this process
// and what each one is doing.
#pragma once
#include <string>

struct loomComm;

namespace loom {

// Called by loomComm::create / ~loomComm.  The first registration installs
// the LOOM_DUMP_SIGNAL handler when that variable is set.
void dumpRegister(loomComm* c);
void dumpUnregister(loomComm* c);

// Every live communicator's dump, one after another.
std::string dumpAll();

}  // namespace loom

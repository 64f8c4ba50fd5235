// Waits that give up cleanly (docs/design.md#clean-timeouts). A kernel wait that passes the
// timeout never traps: it records why in this process's fault record, marks its device failed
// and returns; every other wait of the process then gives up within kAbortPollNs, and the kernels
// end without touching memory they cannot trust. The CUDA context stays usable. From then on
// every communication op of the process fails when its handler runs (resolve_group; a replay of
// a captured command buffer runs no handler), with the message of fault::message(): the op, the
// rank, the phase, and the setting to change. Plain C++, host code: the structs the kernels
// write (FaultRecord, DeviceFault) are in common/limits.h.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/limits.h"  // FaultRecord, DeviceFault, kAbortPollNs: what the kernels see
#include "runtime/device.h"

namespace jax_ep {

// The process's records, one per CUDA device, and the flag every wait polls once it is older
// than kAbortPollNs (host memory: a healthy wait never reads it).
struct HostFaults {
  unsigned int aborted;  // a wait of this process gave up
  unsigned int pad;
  FaultRecord device[kMaxDevices];
};

namespace fault {

// Allocate the host records (once per process) and `device`'s DeviceFault (once per device).
// Set-up only (lowering, attach): never while a handler may be recorded into a command buffer.
// Throws std::runtime_error naming the CUDA call that failed.
void ensure(int device);
// `device`'s DeviceFault, or nullptr when ensure(device) did not run.
DeviceFault* device_state(int device);
// Empty while no wait of this process gave up; else the error every communication op returns.
std::string message();
// The complete records (one per device whose wait timed out), for Python.
std::vector<FaultRecord> records();
// Whether a wait of this process gave up (some wait may have given up without a record: it
// saw another's).
bool aborted();

}  // namespace fault
}  // namespace jax_ep

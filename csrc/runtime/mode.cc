// The choice of the process mode (runtime/mode.h): the one place that makes it.
#include "runtime/mode.h"

#include "nvshmem/symmetric.h"
#include "runtime/virtual_ranks.h"

namespace jax_ep {

const Mode& current_mode() {
  if (sym::active()) return per_process_mode();
  if (virtual_rank() != nullptr) return virtual_ranks_mode();
  return peers_mode();
}

}  // namespace jax_ep

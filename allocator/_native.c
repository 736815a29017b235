/* kvscope.allocator._native: the pool's operations in C, on the segment's bytes; the pool's
 * only writer.
 *
 * It runs allocate (with LRU eviction, preemption and PoolExhausted), free/abort, append (with
 * copy-on-write), mark_computed, fork, set_state, resume and evict, the slot reserve, crash
 * recovery, reclaiming dead processes and close (csrc/recovery.c), for every handle; a lock
 * whose record names a dead holder it recovers itself wherever it meets one.
 *
 * The errors a caller can cause (a closed handle, a forked parent's, a sequence that is not a
 * live one of the handle, a bad argument) it raises itself (entry.c). Inside an operation the
 * core deals with whatever stops a transaction itself (csrc/eviction.c rolled_back: more locks,
 * evicting or preempting ahead, smaller transactions); a case it does not handle is a bug,
 * raised as a RuntimeError naming its place (unhandled). Armed faults and crash points strike
 * the core's operations themselves (csrc/faults.c).
 *
 * Transactions follow docs/FORMAT.md: the client's seq goes odd, locks are taken in the one
 * order (ascending lock index), the old bytes of every shared write are saved in the client's
 * undo journal first (entry count stored last), commit stores 0 into the count, then the locks
 * are released and seq goes even. A process killed anywhere leaves a journal that recovery
 * rolls back.
 *
 * Threads: the core runs with the GIL held, so no other thread of this process runs while it
 * does, except where it lets the GIL go: to wait for another process's OFD lock (holding the
 * mapping's op mutex meanwhile) or in Python it calls; another thread's operation on the handle
 * then in flight is waited for (entry.c gate).
 */
/* The parts, one noun each, compiled as this one translation unit (every function stays
 * static and inlinable): */
#include "csrc/core.h"
#include "csrc/faults.c"
#include "csrc/journal.c"
#include "csrc/locks.c"
#include "csrc/blocks.c"
#include "csrc/prefix.c"
#include "csrc/eviction.c"
#include "csrc/sequences.c"
#include "csrc/tokens.c"
#include "csrc/probes.c"
#include "csrc/recovery.c"
#include "csrc/kvdata.c"
#include "csrc/allocate.c"
#include "csrc/append.c"
#include "csrc/entry.c"
#include "csrc/preempt.c"
#include "csrc/leases.c"
#include "csrc/provenance.c"
#include "csrc/devchecks.c"
#include "csrc/devanswers.c"
#include "csrc/devconfig.c"
#include "csrc/audit.c"
#include "csrc/oplog.c"
#include "csrc/oplogread.c"
#include "csrc/stores.c"
#include "csrc/module.c"

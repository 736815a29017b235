/* kvscope.allocator._native: the pool's hot operations in C, on the same segment bytes.
 *
 * The Python allocator (allocate.py, append.py, release.py, blocks.py, ...) is the reference and
 * does everything; this module does the common case of allocate (with LRU eviction, preemption
 * and PoolExhausted), free/abort, append (with copy-on-write), mark_computed, fork, set_state and resume, with the same writes, the same
 * journal, the same locks and the same checksums, so check(), recovery, dumps and the TUI
 * cannot tell which path wrote a record (tests/test_native.py compares the two byte for byte).
 * Crash recovery, reclaiming dead processes and close are this module's only (csrc/recovery.c),
 * for every handle; a lock whose record names a dead holder it recovers itself wherever it
 * meets one.
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
 * rolls back, exactly as for the Python path.
 *
 * Threads: the C core runs with the GIL held, so no other thread of this process runs while it
 * does; a Python-path operation of another thread may be half done, though (it holds the
 * mapping's op mutex and counts itself in `busy`): then the call returns None and the Python
 * path waits for the mutex. The GIL is released only to wait for another process's OFD
 * lock, and then the core holds the op mutex itself (taken without blocking, or it falls back).
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
#include "csrc/devchecks.c"
#include "csrc/devanswers.c"
#include "csrc/devconfig.c"
#include "csrc/module.c"

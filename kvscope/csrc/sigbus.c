/* kvscope._sigbus: reading a mapped pool file that another process truncates must not kill
 * the reader.
 *
 * `kvscope run` maps the pools of the script it watches read-only. The script (or anything
 * else) can truncate such a file at any moment; a read of a page the file lost raises SIGBUS,
 * whose default action kills the supervisor along with the analysis it owes the user. Checking
 * the size first leaves a window between the check and the read, and Python cannot catch a
 * fault inside a memcpy. So the pages of the ranges registered here are caught instead: the
 * handler maps a zero page over the faulting one (MAP_FIXED, private, anonymous: the read goes
 * on and sees zeros) and counts it. The reader then checks the file's size again and drops what
 * it read. A SIGBUS outside the ranges goes to the handler that was there before (Python's
 * faulthandler, or the default: the process dies as it would have).
 *
 * No library does this for Python (the mmap module has no fault handling), hence this file.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAX_RANGES 256

typedef struct {
    volatile uintptr_t lo, hi;
} Range;

static Range ranges[MAX_RANGES];
static volatile sig_atomic_t hits = 0;
static struct sigaction previous;
static int installed = 0;
static uintptr_t page_size = 4096;

static void on_sigbus(int sig, siginfo_t *info, void *ctx) {
    uintptr_t at = (uintptr_t)info->si_addr;
    for (int i = 0; i < MAX_RANGES; i++) {
        if (at >= ranges[i].lo && at < ranges[i].hi) {
            void *page = (void *)(at & ~(page_size - 1));
            if (mmap(page, page_size, PROT_READ, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) !=
                MAP_FAILED) {
                hits++;
                return; /* the faulting read runs again, on the zero page */
            }
            break;
        }
    }
    /* Not ours: hand it to whoever had it (the faulting read faults again under it). */
    sigaction(SIGBUS, &previous, NULL);
    (void)sig;
    (void)ctx;
}

static int install(void) {
    if (installed)
        return 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &previous) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    long ps = sysconf(_SC_PAGESIZE);
    if (ps > 0)
        page_size = (uintptr_t)ps;
    installed = 1;
    return 0;
}

static PyObject *guard(PyObject *self, PyObject *args) {
    unsigned long long addr, length;
    if (!PyArg_ParseTuple(args, "KK", &addr, &length))
        return NULL;
    if (install() < 0)
        return NULL;
    for (int i = 0; i < MAX_RANGES; i++) {
        if (ranges[i].hi == 0) {
            ranges[i].lo = (uintptr_t)addr;
            ranges[i].hi = (uintptr_t)(addr + length);
            Py_RETURN_TRUE;
        }
    }
    Py_RETURN_FALSE; /* full: that range is read unguarded, as before */
}

static PyObject *unguard(PyObject *self, PyObject *arg) {
    unsigned long long addr = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return NULL;
    for (int i = 0; i < MAX_RANGES; i++) {
        if (ranges[i].lo == (uintptr_t)addr && ranges[i].hi != 0) {
            ranges[i].hi = 0;
            ranges[i].lo = 0;
        }
    }
    Py_RETURN_NONE;
}

static PyObject *get_hits(PyObject *self, PyObject *unused) {
    return PyLong_FromLong((long)hits);
}

static PyMethodDef methods[] = {
    {"guard", guard, METH_VARARGS,
     "guard(addr, length) -> bool: absorb SIGBUS on reads of [addr, addr + length)"},
    {"unguard", unguard, METH_O, "unguard(addr): forget the range starting at addr"},
    {"hits", get_hits, METH_NOARGS, "pages replaced by zeros so far"},
    {NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_sigbus",
                                    "Reads of truncated mapped files that do not kill the reader.",
                                    -1, methods};

PyMODINIT_FUNC PyInit__sigbus(void) { return PyModule_Create(&moddef); }

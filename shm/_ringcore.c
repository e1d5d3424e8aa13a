/*
 * shm._ringcore: the hot paths of shm.Ring in C.
 *
 * The ring's layout, protocol and memory-ordering argument are those drawn at
 * the top of shm/ring.py; this file implements the same steps with the same
 * two POSIX semaphores (opened here by name with sem_open, which glibc maps
 * to the same pages as posix_ipc's handle), so a process using this module
 * and a process using the pure-Python path interoperate on one ring.
 *
 * A Core's methods have the signatures of the Ring methods of the same names
 * and are installed on the Ring instance, so a call costs one C call. Each
 * does the common case completely, or hands over to the Python path by
 * calling ring._c_<method>(code, first, *arguments) at a point it can finish
 * from, said by `code`:
 *
 *   GENERAL  (-1)  nothing was done: run the Python path from the start
 *                  (role not taken yet, held slot, invalid or closed ring,
 *                  bad argument, unusual state);
 *   NO_TOKEN (-2)  nothing was done but a wait of `first` seconds for the
 *                  semaphore came back empty: Python goes on waiting
 *                  (Ring._wait_slow) and then finishes the operation (the
 *                  try_ variants raise WouldBlock);
 *   TOKEN    (-3)  the semaphore token was taken but the rest needs Python
 *                  (invalidated meanwhile, or a slot header to report):
 *                  Python finishes the operation after its wait.
 *
 * Waits release the GIL. A thread inside a method holds a reference to the
 * Core (the call does), and the Core holds a buffer export of the ring's
 * mapping and its semaphores until it is deallocated, so neither is unmapped
 * under a waiter: the same lifetime rule as the Python path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <semaphore.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define GENERAL (-1)
#define NO_TOKEN (-2)
#define TOKEN (-3)
#define FAILED (-4) /* a Python exception is set */

/* Header words (int64), as in shm/ring.py. */
#define W_INVALID 5
#define W_PUBLISHED 8
#define W_HELD 9
#define W_ACQUIRED 16
#define W_RELEASED 17
#define HEADER_SIZE 256
#define SLOT_HEADER_SIZE 64

#include <structmember.h>

/* Copies at least this big run without the GIL. */
#define NOGIL_COPY 65536

typedef struct {
    PyObject_HEAD
    Py_buffer view; /* export of the whole region; released in dealloc only */
    int has_view;
    volatile int64_t *w;
    char *base;
    sem_t *free_sem;
    sem_t *full_sem;
    int64_t slot_size;
    int64_t num_slots;
    int64_t stride;
    int64_t spin_max_ns;
    int64_t spin_min_ns;
    int64_t spin_ns;
    double wait_slice;
    int producer; /* this process has taken the role (set by the Python path) */
    int consumer;
    int closed;   /* Ring.close() was called: everything goes to the Python path */
    PyObject *payload; /* list of per-slot payload memoryviews */
    PyObject *ring;    /* weak reference to the Ring (for the fallbacks) */
} Core;

static int64_t
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline volatile int64_t *
slot_words(Core *c, int64_t i)
{
    return (volatile int64_t *)(c->base + HEADER_SIZE + i * c->stride);
}

static inline char *
slot_payload(Core *c, int64_t i)
{
    return c->base + HEADER_SIZE + i * c->stride + SLOT_HEADER_SIZE;
}

/* Poll `sem` for up to the spin budget and adapt the budget (see Ring._spin). */
static void
spin(Core *c, sem_t *sem)
{
    int v = 0;
    int64_t budget = c->spin_ns;
    int64_t deadline = now_ns() + budget;
    for (;;) {
        for (int k = 0; k < 64; k++) {
            sem_getvalue(sem, &v);
            if (v > 0) {
                if (budget < c->spin_max_ns)
                    c->spin_ns = budget * 2 < c->spin_max_ns ? budget * 2 : c->spin_max_ns;
                return;
            }
        }
        if (now_ns() > deadline)
            break;
    }
    c->spin_ns = budget / 2 > c->spin_min_ns ? budget / 2 : c->spin_min_ns;
}

/* -- untimed waits and their watchdog ------------------------------------
 *
 * A timed futex wait arms and cancels a kernel timer: about 0.25 us on each
 * side of a round trip (measured here: a bare semaphore ping-pong takes 2.3 us
 * with sem_wait, 2.8 us with sem_timedwait). So a wait of a whole slice
 * (WAIT_SLICE: timeout None or >= the slice) blocks in an untimed sem_wait,
 * and a watchdog thread (plain C, no GIL) interrupts it with WAKE_SIGNAL (a
 * handler that does nothing, installed without SA_RESTART, so sem_wait returns
 * EINTR) when its slice is over; the waiter then returns NO_TOKEN and the
 * Python path re-checks close, invalidation, the peer and the deadline, as
 * after a timed slice. A signal that lands just before the thread enters
 * sem_wait is lost: the watchdog signals again every slice until the waiter
 * leaves. The watchdog sleeps while nobody waits (after one quiet slice).
 *
 * The handler is installed lazily, by the first untimed wait, and only while
 * WAKE_SIGNAL still has its default disposition: an application that handles
 * that signal itself keeps it, and the rings then use timed waits (as they do
 * after untimed_waits(False), the setting IPU_EMULATOR_RING_UNTIMED_WAITS=0).
 * The benchmark that justifies it: ring / semaphore round trip 1.09-1.11
 * with untimed waits, 1.24-1.36 with timed ones (tools.bench ring, 2 vCPUs).
 */

#define MAX_WAITERS 256

typedef struct {
    pthread_t tid;
    int64_t kick_ns; /* next signal, CLOCK_MONOTONIC */
    int used;
} Waiter;

static Waiter waiters[MAX_WAITERS];
static pthread_mutex_t wlock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wcond;
static int watchdog_state; /* 0 not started, 1 running, 2 idle in an untimed wait */
static uint64_t registrations;
static int wake_signal;
static int wake_mode; /* 0 undecided, 1 handler installed, -1 timed waits only */

static void
on_wake(int sig)
{
    (void)sig;
}

static void *
watchdog(void *arg)
{
    (void)arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&wlock);
    for (;;) {
        int64_t now = now_ns(), next = INT64_MAX;
        int n = 0;
        for (int i = 0; i < MAX_WAITERS; i++) {
            if (!waiters[i].used)
                continue;
            n++;
            if (waiters[i].kick_ns <= now) {
                pthread_kill(waiters[i].tid, wake_signal);
                waiters[i].kick_ns = now + 1000000; /* again in 1 ms if still there */
            }
            if (waiters[i].kick_ns < next)
                next = waiters[i].kick_ns;
        }
        if (n == 0 && registrations == seen) {
            watchdog_state = 2;
            pthread_cond_wait(&wcond, &wlock);
            watchdog_state = 1;
            continue;
        }
        seen = registrations;
        if (next == INT64_MAX)
            next = now + 50000000; /* linger one slice before going idle */
        struct timespec ts = {next / 1000000000, next % 1000000000};
        pthread_cond_timedwait(&wcond, &wlock, &ts);
    }
    return NULL;
}

/* Register this thread for a signal at `kick_ns`; its index, or -1 (use a timed wait). */
static int
register_waiter(int64_t kick_ns)
{
    int idx = -1;
    pthread_mutex_lock(&wlock);
    if (wake_mode == 0) {
        /* take the signal only if nobody has: an application's handler wins */
        struct sigaction old, sa;
        wake_mode = -1;
        if (sigaction(wake_signal, NULL, &old) == 0 && !(old.sa_flags & SA_SIGINFO)
            && old.sa_handler == SIG_DFL) {
            memset(&sa, 0, sizeof(sa));
            sa.sa_handler = on_wake;
            sigemptyset(&sa.sa_mask);
            sa.sa_flags = 0; /* no SA_RESTART: sem_wait returns EINTR */
            if (sigaction(wake_signal, &sa, NULL) == 0)
                wake_mode = 1;
        }
    }
    if (wake_mode < 0) {
        pthread_mutex_unlock(&wlock);
        return -1;
    }
    if (watchdog_state == 0) {
        pthread_t t;
        pthread_attr_t attr;
        sigset_t all, old;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old); /* the watchdog takes no signal */
        if (pthread_create(&t, &attr, watchdog, NULL) == 0)
            watchdog_state = 1;
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&attr);
        if (watchdog_state == 0) {
            pthread_mutex_unlock(&wlock);
            return -1;
        }
    }
    for (int i = 0; i < MAX_WAITERS; i++) {
        if (!waiters[i].used) {
            waiters[i].tid = pthread_self();
            waiters[i].kick_ns = kick_ns;
            waiters[i].used = 1;
            idx = i;
            break;
        }
    }
    registrations++;
    if (idx >= 0 && watchdog_state == 2)
        pthread_cond_signal(&wcond);
    pthread_mutex_unlock(&wlock);
    return idx;
}

static void
unregister_waiter(int idx)
{
    pthread_mutex_lock(&wlock);
    waiters[idx].used = 0;
    pthread_mutex_unlock(&wlock);
}

/* fork(): the child has no watchdog thread, and wlock must not be left locked by a
 * thread that does not exist there. Hold it across the fork; the child starts
 * again with no waiters and no watchdog (the next untimed wait starts one). */
static void
before_fork(void)
{
    pthread_mutex_lock(&wlock);
}

static void
after_fork_parent(void)
{
    pthread_mutex_unlock(&wlock);
}

static void
after_fork_child(void)
{
    memset(waiters, 0, sizeof(waiters));
    watchdog_state = 0;
    registrations = 0;
    pthread_mutex_unlock(&wlock);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&wcond, &ca);
    pthread_condattr_destroy(&ca);
}

static int
setup_waits(void)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&wcond, &ca);
    pthread_condattr_destroy(&ca);
    if (pthread_atfork(before_fork, after_fork_parent, after_fork_child) != 0)
        return -1;
    wake_signal = SIGRTMIN + 6;
    return 0;
}

/* untimed_waits(on): off makes every later wait a timed one (the handler, if
 * installed, stays: it does nothing); on lets the next untimed wait decide
 * again. Returns whether the handler is installed. */
static PyObject *
untimed_waits(PyObject *mod, PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    pthread_mutex_lock(&wlock);
    if (!on)
        wake_mode = -1;
    else if (wake_mode < 0) {
        struct sigaction cur;
        wake_mode = (sigaction(wake_signal, NULL, &cur) == 0 && cur.sa_handler == on_wake) ? 1 : 0;
    }
    int installed = 0;
    struct sigaction cur;
    if (sigaction(wake_signal, NULL, &cur) == 0 && cur.sa_handler == on_wake)
        installed = 1;
    pthread_mutex_unlock(&wlock);
    return PyBool_FromLong(installed);
}

/* Take one token of `sem`, waiting up to `first` seconds (<= 0: do not block).
 * Returns 0 (taken), NO_TOKEN, or FAILED (a signal handler raised). */
static int
take(Core *c, sem_t *sem, double first)
{
    if (c->spin_ns > 0) {
        int v = 0;
        sem_getvalue(sem, &v);
        if (v <= 0)
            spin(c, sem);
    }
    if (sem_trywait(sem) == 0)
        return 0;
    if (first <= 0)
        return NO_TOKEN;
    int64_t deadline = now_ns() + (int64_t)(first * 1e9);
    int untimed = first >= c->wait_slice;
    for (;;) {
        struct timespec ts;
        int r, err, idx = -1;
        if (untimed)
            idx = register_waiter(deadline);
        if (idx >= 0) {
            Py_BEGIN_ALLOW_THREADS
            r = sem_wait(sem);
            err = errno;
            Py_END_ALLOW_THREADS
            unregister_waiter(idx);
        } else {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30))
            ts.tv_sec = deadline / 1000000000;
            ts.tv_nsec = deadline % 1000000000;
            Py_BEGIN_ALLOW_THREADS
            r = sem_clockwait(sem, CLOCK_MONOTONIC, &ts);
            err = errno;
            Py_END_ALLOW_THREADS
#else
            struct timespec rt;
            clock_gettime(CLOCK_REALTIME, &rt);
            int64_t left = deadline - now_ns();
            int64_t abs_ns = (int64_t)rt.tv_sec * 1000000000 + rt.tv_nsec + (left > 0 ? left : 0);
            ts.tv_sec = abs_ns / 1000000000;
            ts.tv_nsec = abs_ns % 1000000000;
            Py_BEGIN_ALLOW_THREADS
            r = sem_timedwait(sem, &ts);
            err = errno;
            Py_END_ALLOW_THREADS
#endif
        }
        if (r == 0)
            return 0;
        if (err == EINTR) {
            if (PyErr_CheckSignals() < 0)
                return FAILED;
            if (now_ns() < deadline)
                continue;
        }
        return NO_TOKEN;
    }
}

static void
copy_in(char *dst, const void *src, Py_ssize_t n)
{
    if (n >= NOGIL_COPY) {
        Py_BEGIN_ALLOW_THREADS
        memcpy(dst, src, (size_t)n);
        Py_END_ALLOW_THREADS
    } else {
        memcpy(dst, src, (size_t)n);
    }
}

/* -- arguments and fallbacks ------------------------------------------- */

/* Parse up to `n` arguments given by position or by name (FASTCALL|KEYWORDS);
 * out[i] stays NULL for an argument not given. */
static int
parse_args(const char *fn, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
           const char *const *names, int n, int required, PyObject **out)
{
    for (int i = 0; i < n; i++)
        out[i] = NULL;
    if (nargs > n) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments (%zd given)", fn, n,
                     nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        out[i] = args[i];
    if (kwnames != NULL) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t k = 0; k < nk; k++) {
            const char *key = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, k));
            int found = -1;
            if (key == NULL)
                return -1;
            for (int i = 0; i < n; i++)
                if (strcmp(key, names[i]) == 0)
                    found = i;
            if (found < 0 || out[found] != NULL) {
                PyErr_Format(PyExc_TypeError, "%s() got %s keyword argument '%s'", fn,
                             found < 0 ? "an unexpected" : "a repeated", key);
                return -1;
            }
            out[found] = args[nargs + k];
        }
    }
    for (int i = 0; i < required; i++)
        if (out[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fn, names[i]);
            return -1;
        }
    return 0;
}

/* The first wait of a call with `timeout` (None: wait forever), as in Ring._wait. */
static int
first_wait(Core *c, PyObject *timeout, double *first)
{
    if (timeout == NULL || timeout == Py_None) {
        *first = c->wait_slice;
        return 0;
    }
    double t = PyFloat_AsDouble(timeout);
    if (t == -1.0 && PyErr_Occurred())
        return -1;
    *first = t >= c->wait_slice ? c->wait_slice : (t > 0 ? t : 0);
    return 0;
}

/* Take a token of `sem` for a call with `timeout` (ignored unless `blocking`: else a
 * trywait), setting *first to the first wait used. Returns 0 (taken), GENERAL (a
 * timeout that is not a number: the Python path reports it), NO_TOKEN or FAILED. */
static int
take_for(Core *c, sem_t *sem, PyObject *timeout, int blocking, double *first)
{
    *first = 0;
    if (blocking && first_wait(c, timeout, first) < 0) {
        PyErr_Clear();
        return GENERAL;
    }
    return take(c, sem, *first);
}

/* Hand over to the Python path: ring._c_<op>(code, first, *args); FAILED: raise. */
static PyObject *
fallback(Core *c, PyObject *method, int code, double first, PyObject **args, int n)
{
    if (code == FAILED)   /* a signal handler raised during the wait */
        return NULL;
    PyObject *ring = PyWeakref_GetObject(c->ring);
    if (ring == NULL)
        return NULL;
    if (ring == Py_None) {
        PyErr_SetString(PyExc_RuntimeError, "shm._ringcore: the Ring is gone");
        return NULL;
    }
    PyObject *argv[8];
    argv[0] = ring;
    argv[1] = PyLong_FromLong(code);
    argv[2] = PyFloat_FromDouble(first);
    if (argv[1] == NULL || argv[2] == NULL) {
        Py_XDECREF(argv[1]);
        Py_XDECREF(argv[2]);
        return NULL;
    }
    for (int i = 0; i < n; i++)
        argv[3 + i] = args[i] != NULL ? args[i] : Py_None;
    Py_INCREF(ring);
    PyObject *r = PyObject_VectorcallMethod(method, argv, (size_t)(3 + n), NULL);
    Py_DECREF(ring);
    Py_DECREF(argv[1]);
    Py_DECREF(argv[2]);
    return r;
}

static PyObject *s_write, *s_acquire_write, *s_try_acquire_write, *s_publish, *s_acquire_read,
    *s_try_acquire_read, *s_release, *s_read, *s_readable, *s_writable;

/* payload[i][:stop] */
static PyObject *
slot_view(Core *c, int64_t i, int64_t stop)
{
    PyObject *n = PyLong_FromLongLong(stop);
    if (n == NULL)
        return NULL;
    PyObject *sl = PySlice_New(NULL, n, NULL);
    Py_DECREF(n);
    if (sl == NULL)
        return NULL;
    PyObject *view = PyObject_GetItem(PyList_GET_ITEM(c->payload, i), sl);
    Py_DECREF(sl);
    return view;
}

/* Publish the next slot (its payload is written): header, count, then the post. */
static void
publish_slot(Core *c, int64_t nbytes, int64_t tag)
{
    volatile int64_t *w = c->w;
    int64_t k = w[W_PUBLISHED];
    volatile int64_t *s = slot_words(c, k % c->num_slots);
    s[0] = k + 1;
    s[1] = nbytes;
    s[2] = tag;
    w[W_PUBLISHED] = k + 1;
    w[W_HELD] = 0;
    sem_post(c->full_sem);
}

/* The next readable slot is done with (its token was taken): acquire + release. */
static void
consume(Core *c)
{
    volatile int64_t *w = c->w;
    int64_t k = w[W_ACQUIRED];
    w[W_ACQUIRED] = k + 1;
    w[W_RELEASED] = k + 1;
    sem_post(c->free_sem);
}

/* -- producer ------------------------------------------------------------ */

static const char *const write_names[] = {"data", "tag", "timeout"};

/* write(data, tag=0, timeout=None) */
static PyObject *
Core_write(Core *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *a[3];
    double first = 0;
    int code = GENERAL;
    if (parse_args("write", args, nargs, kwnames, write_names, 3, 1, a) < 0)
        return NULL;
    volatile int64_t *w = c->w;
    if (c->closed || !c->producer || w[W_INVALID] || w[W_HELD])
        goto slow;
    int64_t tag = 0;
    if (a[1] != NULL) {
        tag = PyLong_AsLongLong(a[1]);
        if (tag == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto slow;
        }
    }
    Py_buffer b;
    if (PyObject_GetBuffer(a[0], &b, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        goto slow;
    }
    if (b.len > c->slot_size) {
        PyBuffer_Release(&b);
        goto slow;
    }
    if ((code = take_for(c, c->free_sem, a[2], 1, &first)) != 0) {
        PyBuffer_Release(&b);
        goto slow;
    }
    if (w[W_INVALID]) {
        PyBuffer_Release(&b);
        code = TOKEN;
        goto slow;
    }
    copy_in(slot_payload(c, w[W_PUBLISHED] % c->num_slots), b.buf, b.len);
    publish_slot(c, b.len, tag);
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
slow:
    return fallback(c, s_write, code, first, a, 3);
}

static const char *const timeout_names[] = {"timeout"};

static PyObject *
acquire_write(Core *c, PyObject *timeout, int blocking)
{
    double first = 0;
    int code = GENERAL;
    volatile int64_t *w = c->w;
    PyObject *method = blocking ? s_acquire_write : s_try_acquire_write;
    if (c->closed || !c->producer || w[W_INVALID] || w[W_HELD])
        goto slow;
    if ((code = take_for(c, c->free_sem, timeout, blocking, &first)) != 0)
        goto slow;
    if (w[W_INVALID]) {
        code = TOKEN;
        goto slow;
    }
    w[W_HELD] = 1;
    return slot_view(c, w[W_PUBLISHED] % c->num_slots, c->slot_size);
slow:
    return fallback(c, method, code, first, &timeout, blocking ? 1 : 0);
}

/* acquire_write(timeout=None) */
static PyObject *
Core_acquire_write(Core *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *a[1];
    if (parse_args("acquire_write", args, nargs, kwnames, timeout_names, 1, 0, a) < 0)
        return NULL;
    return acquire_write(c, a[0], 1);
}

/* try_acquire_write() */
static PyObject *
Core_try_acquire_write(Core *c, PyObject *Py_UNUSED(ignored))
{
    return acquire_write(c, NULL, 0);
}

static const char *const publish_names[] = {"nbytes", "tag"};

/* publish(nbytes, tag=0) */
static PyObject *
Core_publish(Core *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *a[2];
    if (parse_args("publish", args, nargs, kwnames, publish_names, 2, 1, a) < 0)
        return NULL;
    volatile int64_t *w = c->w;
    int64_t nbytes = PyLong_AsLongLong(a[0]);
    int64_t tag = a[1] == NULL ? 0 : PyLong_AsLongLong(a[1]);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        goto slow;
    }
    if (c->closed || !w[W_HELD] || nbytes < 0 || nbytes > c->slot_size)
        goto slow;
    publish_slot(c, nbytes, tag);
    Py_RETURN_NONE;
slow:
    return fallback(c, s_publish, GENERAL, 0, a, 2);
}

/* -- consumer ------------------------------------------------------------ */

/* (obj, tag), stealing the reference to obj (NULL: an exception is set) */
static PyObject *
with_tag(PyObject *obj, int64_t tag)
{
    if (obj == NULL)
        return NULL;
    PyObject *t = PyLong_FromLongLong(tag);
    PyObject *out = t == NULL ? NULL : PyTuple_New(2);
    if (out == NULL) {
        Py_XDECREF(t);
        Py_DECREF(obj);
        return NULL;
    }
    PyTuple_SET_ITEM(out, 0, obj);
    PyTuple_SET_ITEM(out, 1, t);
    return out;
}

/* The next readable slot after a token was taken: its index and byte count,
 * or -1 if its header is not the expected one (Python reports it). */
static int64_t
next_readable(Core *c, int64_t k, int64_t *nbytes)
{
    int64_t i = k % c->num_slots;
    volatile int64_t *s = slot_words(c, i);
    if (s[0] != k + 1)
        return -1;
    *nbytes = s[1];
    if (*nbytes < 0 || *nbytes > c->slot_size)
        return -1;
    return i;
}

static PyObject *
acquire_read(Core *c, PyObject *timeout, int blocking)
{
    double first = 0;
    int code = GENERAL;
    volatile int64_t *w = c->w;
    PyObject *method = blocking ? s_acquire_read : s_try_acquire_read;
    if (c->closed || !c->consumer || w[W_INVALID])
        goto slow;
    if ((code = take_for(c, c->full_sem, timeout, blocking, &first)) != 0)
        goto slow;
    int64_t nbytes = 0;
    int64_t k = w[W_ACQUIRED];
    int64_t i = w[W_INVALID] ? -1 : next_readable(c, k, &nbytes);
    if (i < 0) {
        code = TOKEN;
        goto slow;
    }
    PyObject *out = with_tag(slot_view(c, i, nbytes), slot_words(c, i)[2]);
    if (out != NULL)
        w[W_ACQUIRED] = k + 1;
    return out;
slow:
    return fallback(c, method, code, first, &timeout, blocking ? 1 : 0);
}

/* acquire_read(timeout=None) */
static PyObject *
Core_acquire_read(Core *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *a[1];
    if (parse_args("acquire_read", args, nargs, kwnames, timeout_names, 1, 0, a) < 0)
        return NULL;
    return acquire_read(c, a[0], 1);
}

/* try_acquire_read() */
static PyObject *
Core_try_acquire_read(Core *c, PyObject *Py_UNUSED(ignored))
{
    return acquire_read(c, NULL, 0);
}

/* release() */
static PyObject *
Core_release(Core *c, PyObject *Py_UNUSED(ignored))
{
    volatile int64_t *w = c->w;
    int64_t k = w[W_RELEASED];
    if (c->closed || k >= w[W_ACQUIRED])
        return fallback(c, s_release, GENERAL, 0, NULL, 0);
    w[W_RELEASED] = k + 1;
    sem_post(c->free_sem);
    Py_RETURN_NONE;
}

/* read(timeout=None) */
static PyObject *
Core_read(Core *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *a[1];
    double first = 0;
    int code = GENERAL;
    if (parse_args("read", args, nargs, kwnames, timeout_names, 1, 0, a) < 0)
        return NULL;
    volatile int64_t *w = c->w;
    int64_t k = w[W_RELEASED];
    if (c->closed || !c->consumer || k != w[W_ACQUIRED] || w[W_INVALID])
        goto slow;
    if ((code = take_for(c, c->full_sem, a[0], 1, &first)) != 0)
        goto slow;
    int64_t nbytes = 0;
    int64_t i = w[W_INVALID] ? -1 : next_readable(c, k, &nbytes);
    if (i < 0) {
        code = TOKEN;
        goto slow;
    }
    PyObject *data = PyBytes_FromStringAndSize(NULL, nbytes);
    if (data == NULL)
        return NULL;
    char *dst = PyBytes_AS_STRING(data);
    if (nbytes >= NOGIL_COPY) {
        Py_BEGIN_ALLOW_THREADS
        memcpy(dst, slot_payload(c, i), (size_t)nbytes);
        Py_END_ALLOW_THREADS
    } else {
        memcpy(dst, slot_payload(c, i), (size_t)nbytes);
    }
    int64_t tag = slot_words(c, i)[2];
    consume(c);
    return with_tag(data, tag);
slow:
    return fallback(c, s_read, code, first, a, 1);
}

/* wait_token(full, seconds) -> True if a token of the full (else free) semaphore was
 * taken within `seconds`. For Ring._wait_slow: unlike posix_ipc's acquire, an
 * exception raised by a signal handler during the wait propagates. */
static PyObject *
Core_wait_token(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "wait_token(full, seconds)");
        return NULL;
    }
    int full = PyObject_IsTrue(args[0]);
    double seconds = PyFloat_AsDouble(args[1]);
    if (full < 0 || (seconds == -1.0 && PyErr_Occurred()))
        return NULL;
    int r = take(c, full ? c->full_sem : c->free_sem, seconds);
    if (r == FAILED)
        return NULL;
    return PyBool_FromLong(r == 0);
}

/* readable(): slots published and not yet acquired */
static PyObject *
Core_readable(Core *c, PyObject *Py_UNUSED(ignored))
{
    if (c->closed)
        return fallback(c, s_readable, GENERAL, 0, NULL, 0);
    return PyLong_FromLongLong(c->w[W_PUBLISHED] - c->w[W_ACQUIRED]);
}

/* writable(): slots the producer could acquire now */
static PyObject *
Core_writable(Core *c, PyObject *Py_UNUSED(ignored))
{
    volatile int64_t *w = c->w;
    if (c->closed)
        return fallback(c, s_writable, GENERAL, 0, NULL, 0);
    return PyLong_FromLongLong(c->num_slots - (w[W_PUBLISHED] - w[W_RELEASED]) - w[W_HELD]);
}

/* -- type --------------------------------------------------------------- */

static int
Core_init(Core *c, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"ring", "buffer", "payload", "free_name", "full_name",
                             "slot_size", "num_slots", "stride", "spin_max_ns", "spin_min_ns",
                             "wait_slice", NULL};
    PyObject *ring, *buffer, *payload;
    const char *free_name, *full_name;
    long long slot_size, num_slots, stride, spin_max, spin_min;
    double wait_slice;
    if (c->has_view) {
        PyErr_SetString(PyExc_RuntimeError, "Core is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO!ssLLLLLd", kwlist, &ring, &buffer,
                                     &PyList_Type, &payload, &free_name, &full_name,
                                     &slot_size, &num_slots, &stride, &spin_max, &spin_min,
                                     &wait_slice))
        return -1;
    c->ring = PyWeakref_NewRef(ring, NULL);
    if (c->ring == NULL)
        return -1;
    c->wait_slice = wait_slice;
    if (num_slots <= 0 || slot_size <= 0 || stride < slot_size + SLOT_HEADER_SIZE
        || PyList_GET_SIZE(payload) != num_slots) {
        PyErr_SetString(PyExc_ValueError, "inconsistent ring geometry");
        return -1;
    }
    if (PyObject_GetBuffer(buffer, &c->view, PyBUF_WRITABLE) < 0)
        return -1;
    c->has_view = 1;
    if (c->view.len < HEADER_SIZE + num_slots * stride) {
        PyErr_SetString(PyExc_ValueError, "buffer is smaller than the ring");
        return -1;
    }
    c->free_sem = sem_open(free_name, 0);
    if (c->free_sem == SEM_FAILED) {
        c->free_sem = NULL;
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, free_name);
        return -1;
    }
    c->full_sem = sem_open(full_name, 0);
    if (c->full_sem == SEM_FAILED) {
        c->full_sem = NULL;
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, full_name);
        return -1;
    }
    c->base = (char *)c->view.buf;
    c->w = (volatile int64_t *)c->view.buf;
    c->slot_size = slot_size;
    c->num_slots = num_slots;
    c->stride = stride;
    c->spin_max_ns = spin_max;
    c->spin_min_ns = spin_min;
    c->spin_ns = spin_max;
    Py_INCREF(payload);
    c->payload = payload;
    return 0;
}

static void
Core_dealloc(Core *c)
{
    if (c->free_sem != NULL)
        sem_close(c->free_sem);
    if (c->full_sem != NULL)
        sem_close(c->full_sem);
    if (c->has_view)
        PyBuffer_Release(&c->view);
    Py_XDECREF(c->payload);
    Py_XDECREF(c->ring);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

#define FASTKW (METH_FASTCALL | METH_KEYWORDS)
static PyMethodDef Core_methods[] = {
    {"write", (PyCFunction)(void (*)(void))Core_write, FASTKW, "Ring.write"},
    {"acquire_write", (PyCFunction)(void (*)(void))Core_acquire_write, FASTKW,
     "Ring.acquire_write"},
    {"try_acquire_write", (PyCFunction)Core_try_acquire_write, METH_NOARGS,
     "Ring.try_acquire_write"},
    {"publish", (PyCFunction)(void (*)(void))Core_publish, FASTKW, "Ring.publish"},
    {"acquire_read", (PyCFunction)(void (*)(void))Core_acquire_read, FASTKW,
     "Ring.acquire_read"},
    {"try_acquire_read", (PyCFunction)Core_try_acquire_read, METH_NOARGS,
     "Ring.try_acquire_read"},
    {"release", (PyCFunction)Core_release, METH_NOARGS, "Ring.release"},
    {"read", (PyCFunction)(void (*)(void))Core_read, FASTKW, "Ring.read"},
    {"readable", (PyCFunction)Core_readable, METH_NOARGS, "Ring.readable"},
    {"wait_token", (PyCFunction)(void (*)(void))Core_wait_token, METH_FASTCALL,
     "wait_token(full, seconds): take a semaphore token within seconds"},
    {"writable", (PyCFunction)Core_writable, METH_NOARGS, "Ring.writable"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Core_members[] = {
    {"producer", T_INT, offsetof(Core, producer), 0, "this process has taken the producer role"},
    {"consumer", T_INT, offsetof(Core, consumer), 0, "this process has taken the consumer role"},
    {"closed", T_INT, offsetof(Core, closed), 0, "the Ring is closed in this process"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shm._ringcore.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The hot paths of one process's end of an shm.Ring.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_members = Core_members,
};

/* -- Step: one step of a stage between rings ------------------------------
 *
 * Step(inputs, input_sizes, outputs, output_sizes, output_names, descriptors,
 *      descriptor_tag, calls).run() -> bool
 *
 * One step of a process that reads one transfer from each input ring (this
 * end: consumer), computes, and writes one transfer to each output ring (this
 * end: producer), done in one C call when everything it needs is there at
 * once:
 *
 *   1. take one published transfer from each input ring: a slot of exactly
 *      input_sizes[i] bytes tagged 0, whose payload is the input; or a slot
 *      tagged descriptor_tag, whose payload bytes are a key of `descriptors`
 *      mapping to (input memoryview, ((output name, output memoryview), ...)):
 *      the input is that memory, and each named output goes to its memory
 *      instead of its ring;
 *   2. take a free slot of each output ring: output j is written into its
 *      payload (output_sizes[j] bytes), or into the memory a descriptor named
 *      for output_names[j];
 *   3. look up calls[(input addresses..., output addresses...)] -> (any, fn,
 *      args) and call fn(*args), which reads the inputs and writes the
 *      outputs at those addresses;
 *   4. publish each output (output_sizes[j] bytes tagged 0, or an empty slot
 *      tagged descriptor_tag for an output written into memory), then release
 *      the inputs.
 *
 * run() returns False and leaves every ring as it was (the semaphore tokens it
 * took are given back) when anything is not as above: a ring closed, invalid,
 * not yet used in its role by this process (the Python path takes the role),
 * holding an acquired slot, empty (inputs) or full (outputs); a slot of
 * another size or tag; a descriptor or an address key not in the tables; a
 * descriptor naming another output. The caller then does the step on the
 * Python path, which waits, reports and fills the tables. If fn raises, the
 * inputs are consumed (released), the outputs are given back unpublished,
 * and the exception propagates.
 *
 * The tables are the caller's dicts, read at each run (they may change
 * between runs). A Step holds its Cores (and so the rings' mappings).
 */

#define STEP_MAX 16

typedef struct {
    PyObject_HEAD
    int n_in;
    int n_out;
    Core *in[STEP_MAX];
    int64_t in_size[STEP_MAX];
    Core *out[STEP_MAX];
    int64_t out_size[STEP_MAX];
    PyObject *out_name[STEP_MAX];
    PyObject *descriptors; /* dict */
    int64_t descriptor_tag;
    PyObject *calls; /* dict */
} Step;

static int
step_cores(PyObject *seq, PyObject *sizes, const char *what, Core **cores, int64_t *size,
           int *n)
{
    if (!PyTuple_Check(seq) || !PyTuple_Check(sizes)
        || PyTuple_GET_SIZE(seq) != PyTuple_GET_SIZE(sizes)) {
        PyErr_Format(PyExc_TypeError, "Step: %s and their sizes must be tuples of one length",
                     what);
        return -1;
    }
    Py_ssize_t len = PyTuple_GET_SIZE(seq);
    if (len > STEP_MAX) {
        PyErr_Format(PyExc_ValueError, "Step: at most %d %s, got %zd", STEP_MAX, what, len);
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        PyObject *c = PyTuple_GET_ITEM(seq, i);
        if (!PyObject_TypeCheck(c, &CoreType)) {
            PyErr_Format(PyExc_TypeError, "Step: %s must be Cores, got %.80s", what,
                         Py_TYPE(c)->tp_name);
            return -1;
        }
        long long sz = PyLong_AsLongLong(PyTuple_GET_ITEM(sizes, i));
        if (sz == -1 && PyErr_Occurred())
            return -1;
        if (sz < 0 || sz > ((Core *)c)->slot_size) {
            PyErr_Format(PyExc_ValueError, "Step: %s %zd: transfers of %lld bytes do not fit "
                         "slots of %lld bytes", what, i, sz, (long long)((Core *)c)->slot_size);
            return -1;
        }
        for (Py_ssize_t k = 0; k < i; k++)
            if (cores[k] == (Core *)c) {
                PyErr_Format(PyExc_ValueError, "Step: %s %zd is also %s %zd", what, i, what, k);
                return -1;
            }
        Py_INCREF(c);
        cores[i] = (Core *)c;
        size[i] = sz;
        *n = (int)(i + 1);
    }
    return 0;
}

static int
Step_init(Step *st, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"inputs", "input_sizes", "outputs", "output_sizes",
                             "output_names", "descriptors", "descriptor_tag", "calls", NULL};
    PyObject *ins, *in_sizes, *outs, *out_sizes, *names, *descriptors, *calls;
    long long tag;
    if (st->calls != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Step is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO!O!LO!", kwlist, &ins, &in_sizes, &outs,
                                     &out_sizes, &PyTuple_Type, &names, &PyDict_Type,
                                     &descriptors, &tag, &PyDict_Type, &calls))
        return -1;
    if (step_cores(ins, in_sizes, "inputs", st->in, st->in_size, &st->n_in) < 0
        || step_cores(outs, out_sizes, "outputs", st->out, st->out_size, &st->n_out) < 0)
        return -1;
    if (PyTuple_GET_SIZE(names) != st->n_out) {
        PyErr_Format(PyExc_ValueError, "Step: %d outputs but %zd output names", st->n_out,
                     PyTuple_GET_SIZE(names));
        return -1;
    }
    if (tag == 0) {
        PyErr_SetString(PyExc_ValueError, "Step: descriptor_tag 0 is the tag of plain data");
        return -1;
    }
    for (int j = 0; j < st->n_out; j++) {
        Py_INCREF(PyTuple_GET_ITEM(names, j));
        st->out_name[j] = PyTuple_GET_ITEM(names, j);
    }
    Py_INCREF(descriptors);
    st->descriptors = descriptors;
    st->descriptor_tag = tag;
    Py_INCREF(calls);
    st->calls = calls;
    return 0;
}

static void
Step_dealloc(Step *st)
{
    for (int i = 0; i < st->n_in; i++)
        Py_DECREF(st->in[i]);
    for (int j = 0; j < st->n_out; j++) {
        Py_DECREF(st->out[j]);
        Py_XDECREF(st->out_name[j]);
    }
    Py_XDECREF(st->descriptors);
    Py_XDECREF(st->calls);
    Py_TYPE(st)->tp_free((PyObject *)st);
}

/* The writable C-contiguous memory of a memoryview of exactly `size` bytes, or NULL. */
static char *
view_memory(PyObject *v, int64_t size, int writable)
{
    if (!PyMemoryView_Check(v))
        return NULL;
    Py_buffer *b = PyMemoryView_GET_BUFFER(v);
    if (b->buf == NULL || b->len != size || (writable && b->readonly)
        || !PyBuffer_IsContiguous(b, 'C'))
        return NULL;
    return (char *)b->buf;
}

/* Resolve input i's descriptor (a slot of nbytes at p); 0, or -1 (not usable). A Python
 * exception is set only for a failed allocation. Adds the entry to `held`. */
static int
step_descriptor(Step *st, int i, const char *p, int64_t nbytes, char **in_ptr, char **out_ptr,
                int *redirected, PyObject **held, int *n_held)
{
    PyObject *key = PyBytes_FromStringAndSize(p, nbytes);
    if (key == NULL)
        return -1;
    PyObject *got = PyDict_GetItemWithError(st->descriptors, key);
    Py_DECREF(key);
    if (got == NULL || !PyTuple_Check(got) || PyTuple_GET_SIZE(got) != 2)
        return -1;
    PyObject *outs = PyTuple_GET_ITEM(got, 1);
    if ((in_ptr[i] = view_memory(PyTuple_GET_ITEM(got, 0), st->in_size[i], 0)) == NULL
        || !PyTuple_Check(outs))
        return -1;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(outs); k++) {
        PyObject *o = PyTuple_GET_ITEM(outs, k);
        int j = -1;
        if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 2)
            return -1;
        for (int m = 0; m < st->n_out && j < 0; m++) {
            int eq = PyObject_RichCompareBool(st->out_name[m], PyTuple_GET_ITEM(o, 0), Py_EQ);
            if (eq < 0)
                return -1;
            if (eq)
                j = m;
        }
        if (j < 0 || redirected[j])
            return -1;
        out_ptr[j] = view_memory(PyTuple_GET_ITEM(o, 1), st->out_size[j], 1);
        if (out_ptr[j] == NULL)
            return -1;
        redirected[j] = 1;
    }
    Py_INCREF(got);
    held[(*n_held)++] = got;
    return 0;
}

/* One step: 1 (done), 0 (nothing done), -1 (fn raised, or no memory: an exception is set). */
static int
step_once(Step *st)
{
    char *in_ptr[STEP_MAX], *out_ptr[STEP_MAX];
    int redirected[STEP_MAX] = {0};
    PyObject *held[STEP_MAX];
    int n_held = 0, taken_in = 0, taken_out = 0, i, j, result = 0;
    PyObject *key = NULL;

    for (i = 0; i < st->n_in; i++) {
        Core *c = st->in[i];
        volatile int64_t *w = c->w;
        int64_t nbytes = 0, slot;
        if (c->closed || !c->consumer || w[W_INVALID] || w[W_RELEASED] != w[W_ACQUIRED]
            || w[W_PUBLISHED] == w[W_ACQUIRED] || sem_trywait(c->full_sem) != 0)
            goto undo;
        taken_in++;
        if ((slot = next_readable(c, w[W_ACQUIRED], &nbytes)) < 0)
            goto undo;
        int64_t tag = slot_words(c, slot)[2];
        if (tag == 0 && nbytes == st->in_size[i])
            in_ptr[i] = slot_payload(c, slot);
        else if (tag != st->descriptor_tag
                 || step_descriptor(st, i, slot_payload(c, slot), nbytes, in_ptr, out_ptr,
                                    redirected, held, &n_held) < 0)
            goto undo;
    }
    for (j = 0; j < st->n_out; j++) {
        Core *c = st->out[j];
        volatile int64_t *w = c->w;
        if (c->closed || !c->producer || w[W_INVALID] || w[W_HELD]
            || sem_trywait(c->free_sem) != 0)
            goto undo;
        taken_out++;
        if (!redirected[j])
            out_ptr[j] = slot_payload(c, w[W_PUBLISHED] % c->num_slots);
    }
    if ((key = PyTuple_New(st->n_in + st->n_out)) == NULL)
        goto undo;
    for (i = 0; i < st->n_in + st->n_out; i++) {
        PyObject *a = PyLong_FromVoidPtr(i < st->n_in ? in_ptr[i] : out_ptr[i - st->n_in]);
        if (a == NULL)
            goto undo;
        PyTuple_SET_ITEM(key, i, a);
    }
    PyObject *entry = PyDict_GetItemWithError(st->calls, key);
    if (entry == NULL || !PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3
        || !PyTuple_Check(PyTuple_GET_ITEM(entry, 2)))
        goto undo;
    Py_INCREF(entry);
    PyObject *r = PyObject_Call(PyTuple_GET_ITEM(entry, 1), PyTuple_GET_ITEM(entry, 2), NULL);
    Py_DECREF(entry);
    if (r == NULL) {
        for (i = 0; i < st->n_in; i++)
            consume(st->in[i]);
        taken_in = 0;
        result = -1;
        goto undo;
    }
    Py_DECREF(r);
    for (j = 0; j < st->n_out; j++)
        publish_slot(st->out[j], redirected[j] ? 0 : st->out_size[j],
                     redirected[j] ? st->descriptor_tag : 0);
    for (i = 0; i < st->n_in; i++)
        consume(st->in[i]);
    Py_DECREF(key);
    for (i = 0; i < n_held; i++)
        Py_DECREF(held[i]);
    return 1;
undo:
    /* give back every token taken: the rings are as before the call */
    for (i = 0; i < taken_in; i++)
        sem_post(st->in[i]->full_sem);
    for (j = 0; j < taken_out; j++)
        sem_post(st->out[j]->free_sem);
    Py_XDECREF(key);
    for (i = 0; i < n_held; i++)
        Py_DECREF(held[i]);
    if (result < 0)
        return -1;
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_MemoryError))
            PyErr_Clear();   /* e.g. an unhashable or odd table entry: the Python path decides */
        else
            return -1;
    }
    return 0;
}

static PyObject *
Step_run(Step *st, PyObject *Py_UNUSED(ignored))
{
    int r = step_once(st);
    if (r < 0)
        return NULL;
    return PyBool_FromLong(r);
}

static const char *const run_many_names[] = {"unit", "deadline_ns", "watch"};

/* run_many(unit, deadline_ns, watch=None) -> steps done: units of `unit` steps back to
 * back, while the monotonic clock is before deadline_ns and the ring end `watch` (a Core
 * this process consumes from) is open, valid and has nothing to read; a step that cannot
 * be done ends it, even inside a unit (the count then is not a multiple of `unit`). */
static PyObject *
Step_run_many(Step *st, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *a[3];
    if (parse_args("run_many", args, nargs, kwnames, run_many_names, 3, 2, a) < 0)
        return NULL;
    long long unit = PyLong_AsLongLong(a[0]);
    long long deadline = PyLong_AsLongLong(a[1]);
    if (PyErr_Occurred())
        return NULL;
    if (unit < 1) {
        PyErr_Format(PyExc_ValueError, "run_many: unit must be at least 1, got %lld", unit);
        return NULL;
    }
    Core *watch = NULL;
    if (a[2] != NULL && a[2] != Py_None) {
        if (!PyObject_TypeCheck(a[2], &CoreType)) {
            PyErr_Format(PyExc_TypeError, "run_many: watch must be a Core or None, got %.80s",
                         Py_TYPE(a[2])->tp_name);
            return NULL;
        }
        watch = (Core *)a[2];
    }
    long long done = 0;
    while (now_ns() < deadline
           && (watch == NULL || (!watch->closed && !watch->w[W_INVALID]
                                 && watch->w[W_PUBLISHED] == watch->w[W_ACQUIRED]))) {
        for (long long u = 0; u < unit; u++) {
            int r = step_once(st);
            if (r < 0)
                return NULL;
            if (r == 0)
                return PyLong_FromLongLong(done);
            done++;
        }
    }
    return PyLong_FromLongLong(done);
}

static PyMethodDef Step_methods[] = {
    {"run", (PyCFunction)Step_run, METH_NOARGS,
     "run() -> True if one step was done, False if nothing was done (see the type's doc)."},
    {"run_many", (PyCFunction)(void (*)(void))Step_run_many, FASTKW,
     "run_many(unit, deadline_ns, watch=None) -> steps done back to back (see the C file)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StepType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shm._ringcore.Step",
    .tp_basicsize = sizeof(Step),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One step of a stage between rings, in one C call (see shm/_ringcore.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Step_init,
    .tp_dealloc = (destructor)Step_dealloc,
    .tp_methods = Step_methods,
};

/* address(buffer) -> the address of its first byte (for onnxruntime IO bindings) */
static PyObject *
address(PyObject *module, PyObject *obj)
{
    Py_buffer b;
    if (PyObject_GetBuffer(obj, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = PyLong_FromVoidPtr(b.buf);
    PyBuffer_Release(&b);
    return out;
}

static PyMethodDef module_methods[] = {
    {"address", (PyCFunction)address, METH_O,
     "address(buffer): the address of a C-contiguous buffer's first byte."},
    {"untimed_waits", (PyCFunction)untimed_waits, METH_O,
     "untimed_waits(on) -> bool: allow (or stop) untimed waits woken by SIGRTMIN+6; "
     "returns whether the wake handler is installed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shm._ringcore",
    "C hot paths of shm.Ring (same layout and protocol as the Python path).", -1,
    module_methods,
};

PyMODINIT_FUNC
PyInit__ringcore(void)
{
    if (PyType_Ready(&CoreType) < 0 || PyType_Ready(&StepType) < 0)
        return NULL;
    if (setup_waits() < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    struct {
        PyObject **where;
        const char *name;
    } names[] = {
        {&s_write, "_c_write"}, {&s_acquire_write, "_c_acquire_write"},
        {&s_try_acquire_write, "_c_try_acquire_write"}, {&s_publish, "_c_publish"},
        {&s_acquire_read, "_c_acquire_read"}, {&s_try_acquire_read, "_c_try_acquire_read"},
        {&s_release, "_c_release"}, {&s_read, "_c_read"}, {&s_readable, "_c_readable"},
        {&s_writable, "_c_writable"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        *names[i].where = PyUnicode_InternFromString(names[i].name);
        if (*names[i].where == NULL)
            return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&StepType);
    if (PyModule_AddObject(m, "Step", (PyObject *)&StepType) < 0) {
        Py_DECREF(&StepType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "GENERAL", GENERAL);
    PyModule_AddIntConstant(m, "NO_TOKEN", NO_TOKEN);
    PyModule_AddIntConstant(m, "TOKEN", TOKEN);
    return m;
}

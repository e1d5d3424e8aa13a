/*
 * shm._ringcore: the hot paths of shm.Ring in C.
 *
 * The ring's layout, protocol and memory-ordering argument are those drawn at
 * the top of shm/ring.py; this file implements the same steps with the same
 * two process-shared POSIX semaphores (in the ring's header, at the offsets
 * below; shm/_semaphore.py is the Python path's handle on them), so a process
 * using this module and a process using the pure-Python path interoperate on
 * one ring.
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
 *                  semaphore came back empty (its deadline, a peer check
 *                  due, or an interrupt): Python checks why, goes on waiting
 *                  (Ring._wait_slow, shm/_ring_waits.py) and then finishes
 *                  the operation (the try_ variants raise WouldBlock);
 *   TOKEN    (-3)  the semaphore token was taken but the rest needs Python
 *                  (invalidated meanwhile, or a slot header to report): it is
 *                  banked in the Ring's spare list first (see Core.spare),
 *                  and Python finishes the operation with it.
 *
 * Other C extensions reach a ring end through the C API declared in
 * shm/_ringcore.h (capsule shm._ringcore._C_API, handle Ring.c_handle()):
 * take / give back / consume / publish slots without waiting. This module
 * knows rings, regions and semaphores only; what a slot's tag means to a
 * user of the ring is that user's business.
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
#include <semaphore.h>
#include <signal.h>
#include <sys/types.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <time.h>

#define GENERAL (-1)
#define NO_TOKEN (-2)
#define TOKEN (-3)
#define FAILED (-4) /* a Python exception is set */

/* Header words (int64), as drawn in shm/ring.py (indices: shm/_ring_layout.py). */
#define W_INVALID 5
#define W_PUBLISHED 8
#define W_HELD 9
#define W_ACQUIRED 16
#define W_RELEASED 17
#define W_DOORBELL 25
#define W_READ_TAG 19   /* tag of the last message acquired (the consumer's record) */
#define SEM_FREE_OFFSET 256 /* the two sem_t, each on a cache line of its own */
#define SEM_FULL_OFFSET 320
#define HEADER_SIZE 384
#define SLOT_HEADER_SIZE 64
_Static_assert(sizeof(sem_t) <= SEM_FULL_OFFSET - SEM_FREE_OFFSET, "sem_t fits its cache line");

#include <structmember.h>

#include "_ringcore.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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
    double check_s; /* a wait with a peer to watch is cut after this many seconds (0: none) */
    int interrupted; /* Core.interrupt(): waits return at once (WOKEN) until resume() */
    int blocked[2];  /* threads blocked on [free, full] now (under wlock) */
    int pending[2];  /* tokens interrupt() posted to [free, full] not yet taken back */
    int producer; /* this process has taken the role (set by the Python path) */
    int consumer;
    int closed;   /* Ring.close() was called: everything goes to the Python path */
    PyObject *payload; /* list of per-slot payload memoryviews */
    PyObject *ring;    /* weak reference to the Ring (for the fallbacks) */
    /* The Ring's token banks [_spare_free, _spare_full] (lists of None): a token taken
     * for a caller that finishes in Python (wait_token, try_token, code TOKEN) is
     * appended in the same C call that takes it, so no exception raised after the call
     * returns (a signal handler's, an asynchronous one) can lose it; whoever uses the
     * slot takes it out in the same step as it moves the ring's counter (see
     * Ring._acquire_token, shm/_ring_waits.py). A non-empty bank sends a call to the
     * Python path, which uses the banked token first. */
    PyObject *spare[2];
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

/* -- waits ---------------------------------------------------------------
 *
 * A wait sleeps until the earliest of its deadline and a token: an untimed
 * sem_wait when there is no deadline (timeout None, no peer to watch), else one
 * sem_clockwait to the deadline. Nothing wakes it periodically. What may end it
 * early, each by posting the semaphore:
 *
 *   - a token (the peer published or released a slot);
 *   - invalidate(), from either process (posts both semaphores once);
 *   - interrupt() of this Core, from another thread of this process (Ring.close
 *     and Ring.interrupt): it posts one token for each thread blocked on this
 *     Core now, counted in `pending`, and sets `interrupted`, so that later waits
 *     return at once too. A thread that takes a token while `pending` is non-zero
 *     counts it as one of those (tokens are interchangeable: a real one stays in
 *     the semaphore instead) and returns WOKEN; a non-blocking take skips it and
 *     tries again. `blocked` and `pending` change under `wlock`, so an interrupt
 *     never misses a thread about to block, and never posts for one that left.
 *
 * A peer's death cannot post a semaphore: a wait with a peer to watch (check_s,
 * set by Ring.set_peer) is cut after check_s seconds for the Python path to check
 * the peer, which is cheap (a pidfd poll). Waits without a peer (an IPU process
 * waiting for its host: the host is watched by a thread of that process, which
 * interrupts its waits) have no such cut.
 */

#define WOKEN (-5)

static pthread_mutex_t wlock = PTHREAD_MUTEX_INITIALIZER;
/* broadcast (under wlock) whenever a thread leaves a wait: wait_unblocked() */
static pthread_cond_t left_wait = PTHREAD_COND_INITIALIZER;

/* fork(): wlock must not be left locked by a thread that does not exist in the child
 * (whose Rings are disowned anyway: see shm/ring.py). */
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
    pthread_mutex_unlock(&wlock);
}

static inline int
sem_index(Core *c, sem_t *sem)
{
    return sem == c->full_sem;
}

/* A token of `sem` was taken: was it one interrupt() posted? (then it is counted
 * back and the caller treats it as a wake) */
static int
took_pending(Core *c, sem_t *sem)
{
    int i = sem_index(c, sem), was = 0;
    if (__atomic_load_n(&c->pending[i], __ATOMIC_ACQUIRE) == 0)
        return 0;
    pthread_mutex_lock(&wlock);
    if (c->pending[i] > 0) {
        c->pending[i]--;
        was = 1;
    }
    pthread_mutex_unlock(&wlock);
    return was;
}

/* sem_trywait that skips the tokens interrupt() posted: 1 if a real one was taken */
static int
try_token(Core *c, sem_t *sem)
{
    while (sem_trywait(sem) == 0) {
        if (!took_pending(c, sem))
            return 1;
    }
    return 0;
}

/* Under wlock, as a thread leaves its wait: interrupt() posted a token for each thread
 * blocked then, and one that left without taking its token (its wait timed out, or was
 * cut by a signal, as the token came) would leave it in the semaphore for good. The
 * semaphore is shared with the peer process: a consumer there would take it for a
 * published slot that is not ("slot k holds message 0"). So while more tokens are
 * pending than threads are left blocked to take them, take them back. */
static void
take_back_unclaimed(Core *c, sem_t *sem, int i)
{
    while (c->pending[i] > c->blocked[i] && sem_trywait(sem) == 0)
        c->pending[i]--;
}

/* A token of `sem` is taken: bank it (see Core.spare). 0, or FAILED with the token given
 * back (no memory). */
static int
bank(Core *c, sem_t *sem)
{
    if (PyList_Append(c->spare[sem_index(c, sem)], Py_None) < 0) {
        sem_post(sem);
        return FAILED;
    }
    return 0;
}

/* Tokens banked for `sem` and not used yet (then the Python path runs). */
static inline int
banked(Core *c, sem_t *sem)
{
    return PyList_GET_SIZE(c->spare[sem_index(c, sem)]) != 0;
}

/* Post one token per thread blocked on this Core, and make later waits return at once. */
static void
interrupt_core(Core *c)
{
    pthread_mutex_lock(&wlock);
    __atomic_store_n(&c->interrupted, 1, __ATOMIC_RELEASE);
    for (int i = 0; i < 2; i++) {
        sem_t *sem = i ? c->full_sem : c->free_sem;
        for (int k = 0; k < c->blocked[i]; k++) {
            __atomic_add_fetch(&c->pending[i], 1, __ATOMIC_RELEASE);
            sem_post(sem);
        }
    }
    pthread_mutex_unlock(&wlock);
}

/* Take one token of `sem`, waiting up to `first` seconds (<= 0: do not block; infinite:
 * no deadline), after a spin if one is set. Returns 0 (taken), NO_TOKEN (the time is
 * up), WOKEN (interrupted) or FAILED (a signal handler raised); *waited: the seconds
 * it waited. */
static int
take(Core *c, sem_t *sem, double first, double *waited)
{
    *waited = 0;
    if (c->spin_ns > 0) {
        int v = 0;
        sem_getvalue(sem, &v);
        if (v <= 0)
            spin(c, sem);
    }
    if (try_token(c, sem))
        return 0;
    if (first <= 0)
        return NO_TOKEN;
    int64_t t0 = now_ns();
    int untimed = isinf(first);
    int64_t deadline = untimed ? INT64_MAX : t0 + (int64_t)(first * 1e9);
    int i = sem_index(c, sem);
    for (;;) {
        int r, err;
        pthread_mutex_lock(&wlock);
        if (c->interrupted) {
            pthread_mutex_unlock(&wlock);
            *waited = (now_ns() - t0) / 1e9;
            return WOKEN;
        }
        c->blocked[i]++;
        pthread_mutex_unlock(&wlock);
        if (untimed) {
            Py_BEGIN_ALLOW_THREADS
            r = sem_wait(sem);
            err = errno;
            Py_END_ALLOW_THREADS
        } else {
            struct timespec ts;
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
        pthread_mutex_lock(&wlock);
        c->blocked[i]--;
        int woken = r == 0 && c->pending[i] > 0;
        if (woken)
            c->pending[i]--;
        take_back_unclaimed(c, sem, i);
        pthread_cond_broadcast(&left_wait);
        pthread_mutex_unlock(&wlock);
        if (r == 0) {
            if (woken) {
                *waited = (now_ns() - t0) / 1e9;
                return WOKEN;
            }
            /* A signal that came while this thread slept (delivered to another thread,
             * so no EINTR here) runs its handler now, before anything is consumed: if
             * the handler raises, the token goes back and the call raises, so that an
             * interrupted read never drops the message it took. */
            if (PyErr_CheckSignals() < 0) {
                sem_post(sem);
                return FAILED;
            }
            return 0;
        }
        if (err == EINTR) {
            if (PyErr_CheckSignals() < 0)
                return FAILED;
            if (now_ns() < deadline)
                continue;
        }
        *waited = (now_ns() - t0) / 1e9;
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

/* Whether a free-slot token just taken is one too many: every slot is in use, so no
 * free token can be real (the consumer counts a release before it posts the token). It
 * was banked by this end before the peer reset the ring (a wait an invalidation woke:
 * its token is banked as the call raises), and is dropped: used, it would overwrite the
 * oldest unread message. */
static inline int
surplus_free(Core *c)
{
    volatile int64_t *w = c->w;
    return w[W_PUBLISHED] - w[W_RELEASED] >= c->num_slots;
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

/* The wait of a call with `timeout` (None: no deadline), as in Ring._wait: cut at
 * check_s when a peer is watched. */
static int
first_wait(Core *c, PyObject *timeout, double *first)
{
    double t = INFINITY;
    if (timeout != NULL && timeout != Py_None) {
        t = PyFloat_AsDouble(timeout);
        if (t == -1.0 && PyErr_Occurred())
            return -1;
        if (!(t > 0))
            t = 0;
    }
    *first = c->check_s > 0 && c->check_s < t ? c->check_s : t;
    return 0;
}

/* Take a token of `sem` for a call with `timeout` (ignored unless `blocking`: else a
 * trywait), setting *waited to the seconds waited. Returns 0 (taken), GENERAL (a
 * timeout that is not a number: the Python path reports it), NO_TOKEN (also when
 * interrupted: the Python path sees why) or FAILED. */
static int
take_for(Core *c, sem_t *sem, PyObject *timeout, int blocking, double *waited)
{
    double first = 0;
    *waited = 0;
    if (blocking && first_wait(c, timeout, &first) < 0) {
        PyErr_Clear();
        return GENERAL;
    }
    int r = take(c, sem, first, waited);
    return r == WOKEN ? NO_TOKEN : r;
}

/* Hand over to the Python path: ring._c_<op>(code, first, *args); FAILED: raise. With
 * code TOKEN, the token taken of `tok_sem` is banked first. */
static PyObject *
fallback(Core *c, PyObject *method, int code, double first, PyObject **args, int n,
         sem_t *tok_sem)
{
    if (code == FAILED)   /* a signal handler raised during the wait */
        return NULL;
    if (code == TOKEN && bank(c, tok_sem) < 0)   /* Python finishes: bank the token first */
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
    int64_t bell = w[W_DOORBELL];   /* the consumer asked for a signal (Ring.set_doorbell) */
    if (bell)
        kill((pid_t)(bell >> 8), (int)(bell & 0xFF));
}

/* The next readable slot is done with (its token was taken): acquire + release. */
static void
consume(Core *c)
{
    volatile int64_t *w = c->w;
    int64_t k = w[W_ACQUIRED];
    w[W_READ_TAG] = slot_words(c, k % c->num_slots)[2];
    w[W_ACQUIRED] = k + 1;
    w[W_RELEASED] = k + 1;
    sem_post(c->free_sem);
}

/* -- producer ------------------------------------------------------------ */

static const char *const write_names[] = {"data", "tag", "timeout"};

/* Core.write's fast path for the bytes of `b`: 1 if they were copied into a slot and
 * published; 0 if not, with nothing done but what *code says for fallback() (TOKEN: a
 * token of the free semaphore was taken, to bank; FAILED: an exception is set). */
static int
write_fast(Core *c, const Py_buffer *b, int64_t tag, PyObject *timeout, int *code,
           double *first)
{
    volatile int64_t *w = c->w;
    *code = GENERAL;
    *first = 0;
    if (c->closed || !c->producer || w[W_INVALID] || w[W_HELD] || banked(c, c->free_sem)
        || b->len > c->slot_size)
        return 0;
    if ((*code = take_for(c, c->free_sem, timeout, 1, first)) != 0)
        return 0;
    if (w[W_INVALID]) {
        *code = TOKEN;
        return 0;
    }
    if (surplus_free(c)) {   /* dropped; the Python path waits for a real one */
        *code = GENERAL;
        return 0;
    }
    copy_in(slot_payload(c, w[W_PUBLISHED] % c->num_slots), b->buf, b->len);
    publish_slot(c, b->len, tag);
    return 1;
}

/* write(data, tag=0, timeout=None) */
static PyObject *
Core_write(Core *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *a[3];
    double first = 0;
    int code = GENERAL;
    if (parse_args("write", args, nargs, kwnames, write_names, 3, 1, a) < 0)
        return NULL;
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
    int done = write_fast(c, &b, tag, a[2], &code, &first);
    PyBuffer_Release(&b);
    if (done)
        Py_RETURN_NONE;
slow:
    return fallback(c, s_write, code, first, a, 3, c->free_sem);
}

static const char *const timeout_names[] = {"timeout"};

static PyObject *
acquire_write(Core *c, PyObject *timeout, int blocking)
{
    double first = 0;
    int code = GENERAL;
    volatile int64_t *w = c->w;
    PyObject *method = blocking ? s_acquire_write : s_try_acquire_write;
    if (c->closed || !c->producer || w[W_INVALID] || w[W_HELD] || banked(c, c->free_sem))
        goto slow;
    if ((code = take_for(c, c->free_sem, timeout, blocking, &first)) != 0)
        goto slow;
    if (w[W_INVALID]) {
        code = TOKEN;
        goto slow;
    }
    if (surplus_free(c)) {   /* dropped; the Python path waits for a real one */
        code = GENERAL;
        goto slow;
    }
    w[W_HELD] = 1;
    return slot_view(c, w[W_PUBLISHED] % c->num_slots, c->slot_size);
slow:
    return fallback(c, method, code, first, &timeout, blocking ? 1 : 0, c->free_sem);
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
    return fallback(c, s_publish, GENERAL, 0, a, 2, NULL);
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
    if (c->closed || !c->consumer || w[W_INVALID] || banked(c, c->full_sem))
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
    int64_t tag = slot_words(c, i)[2];
    PyObject *out = with_tag(slot_view(c, i, nbytes), tag);
    if (out != NULL) {
        w[W_READ_TAG] = tag;
        w[W_ACQUIRED] = k + 1;
    } else {
        sem_post(c->full_sem);   /* the message stays for the next read */
    }
    return out;
slow:
    return fallback(c, method, code, first, &timeout, blocking ? 1 : 0, c->full_sem);
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
        return fallback(c, s_release, GENERAL, 0, NULL, 0, NULL);
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
    if (c->closed || !c->consumer || k != w[W_ACQUIRED] || w[W_INVALID]
        || banked(c, c->full_sem))
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
    if (data == NULL) {
        sem_post(c->full_sem);   /* the message stays for the next read */
        return NULL;
    }
    char *dst = PyBytes_AS_STRING(data);
    if (nbytes >= NOGIL_COPY) {
        Py_BEGIN_ALLOW_THREADS
        memcpy(dst, slot_payload(c, i), (size_t)nbytes);
        Py_END_ALLOW_THREADS
    } else {
        memcpy(dst, slot_payload(c, i), (size_t)nbytes);
    }
    int64_t tag = slot_words(c, i)[2];
    consume(c);   /* records the tag as the last read */
    return with_tag(data, tag);
slow:
    return fallback(c, s_read, code, first, a, 1, c->full_sem);
}

/* wait_token(full, seconds) -> True if a token of the full (else free) semaphore was
 * taken (and banked: see Core.spare) within `seconds` (None: no deadline; <= 0: do not block); False when the time
 * is up or the Core is interrupted. For Ring._wait_slow: unlike posix_ipc's acquire,
 * an exception raised by a signal handler during the wait propagates. */
static PyObject *
Core_wait_token(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "wait_token(full, seconds)");
        return NULL;
    }
    int full = PyObject_IsTrue(args[0]);
    double seconds = INFINITY, waited;
    if (args[1] != Py_None)
        seconds = PyFloat_AsDouble(args[1]);
    if (full < 0 || (seconds == -1.0 && PyErr_Occurred()))
        return NULL;
    sem_t *sem = full ? c->full_sem : c->free_sem;
    int r = take(c, sem, seconds, &waited);
    if (r == 0 && bank(c, sem) < 0)
        r = FAILED;
    if (r == FAILED)
        return NULL;
    return PyBool_FromLong(r == 0);
}

/* try_token(full) -> True if a token of the full (else free) semaphore was taken (and
 * banked: see Core.spare) now */
static PyObject *
Core_try_token(Core *c, PyObject *arg)
{
    int full = PyObject_IsTrue(arg);
    if (full < 0)
        return NULL;
    sem_t *sem = full ? c->full_sem : c->free_sem;
    if (!try_token(c, sem))
        Py_RETURN_FALSE;
    if (bank(c, sem) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

/* interrupt(): wake this process's threads blocked on this end; later waits return at
 * once (wait_token: False) until resume() */
static PyObject *
Core_interrupt(Core *c, PyObject *Py_UNUSED(ignored))
{
    interrupt_core(c);
    Py_RETURN_NONE;
}

/* resume(): waits block again (after interrupt()) */
static PyObject *
Core_resume(Core *c, PyObject *Py_UNUSED(ignored))
{
    __atomic_store_n(&c->interrupted, 0, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* wait_unblocked(timeout): wait (GIL released) until no thread of this process is blocked
 * on this Core, at most `timeout` seconds; True if none is. After interrupt() (Ring.close)
 * the tokens it posted are in the semaphores, which the peer process shares: a woken
 * thread that has not taken its token back yet leaves it for a consumer there to take
 * for a slot never published. So close() waits for them (they are awake: a moment). */
static PyObject *
Core_wait_unblocked(Core *c, PyObject *arg)
{
    double t = PyFloat_AsDouble(arg);
    if (t == -1.0 && PyErr_Occurred())
        return NULL;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t abs_ns = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec
                     + (t > 0 ? (int64_t)(t * 1e9) : 0);
    ts.tv_sec = abs_ns / 1000000000;
    ts.tv_nsec = abs_ns % 1000000000;
    int left;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&wlock);
    while (c->blocked[0] + c->blocked[1] > 0
           && pthread_cond_timedwait(&left_wait, &wlock, &ts) != ETIMEDOUT)
        ;
    left = c->blocked[0] + c->blocked[1];
    pthread_mutex_unlock(&wlock);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(left == 0);
}

/* forget_wakes(): the semaphores were emptied (Ring.reset): no token of interrupt()
 * is left in them */
static PyObject *
Core_forget_wakes(Core *c, PyObject *Py_UNUSED(ignored))
{
    pthread_mutex_lock(&wlock);
    c->pending[0] = c->pending[1] = 0;
    pthread_mutex_unlock(&wlock);
    Py_RETURN_NONE;
}

/* readable(): slots published and not yet acquired */
static PyObject *
Core_readable(Core *c, PyObject *Py_UNUSED(ignored))
{
    if (c->closed)
        return fallback(c, s_readable, GENERAL, 0, NULL, 0, NULL);
    return PyLong_FromLongLong(c->w[W_PUBLISHED] - c->w[W_ACQUIRED]);
}

/* writable(): slots the producer could acquire now */
static PyObject *
Core_writable(Core *c, PyObject *Py_UNUSED(ignored))
{
    volatile int64_t *w = c->w;
    if (c->closed)
        return fallback(c, s_writable, GENERAL, 0, NULL, 0, NULL);
    return PyLong_FromLongLong(c->num_slots - (w[W_PUBLISHED] - w[W_RELEASED]) - w[W_HELD]);
}

/* -- type --------------------------------------------------------------- */

static int
Core_init(Core *c, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"ring", "buffer", "payload", "slot_size", "num_slots", "stride",
                             "spin_max_ns", "spin_min_ns", "spare_free", "spare_full", NULL};
    PyObject *ring, *buffer, *payload, *spare_free, *spare_full;
    long long slot_size, num_slots, stride, spin_max, spin_min;
    if (c->has_view) {
        PyErr_SetString(PyExc_RuntimeError, "Core is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO!LLLLLO!O!", kwlist, &ring, &buffer,
                                     &PyList_Type, &payload,
                                     &slot_size, &num_slots, &stride, &spin_max, &spin_min,
                                     &PyList_Type, &spare_free, &PyList_Type, &spare_full))
        return -1;
    c->ring = PyWeakref_NewRef(ring, NULL);
    if (c->ring == NULL)
        return -1;
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
    c->base = (char *)c->view.buf;
    c->free_sem = (sem_t *)(c->base + SEM_FREE_OFFSET);
    c->full_sem = (sem_t *)(c->base + SEM_FULL_OFFSET);
    c->w = (volatile int64_t *)c->view.buf;
    c->slot_size = slot_size;
    c->num_slots = num_slots;
    c->stride = stride;
    c->spin_max_ns = spin_max;
    c->spin_min_ns = spin_min;
    c->spin_ns = spin_max;
    Py_INCREF(payload);
    c->payload = payload;
    Py_INCREF(spare_free);
    c->spare[0] = spare_free;
    Py_INCREF(spare_full);
    c->spare[1] = spare_full;
    return 0;
}

static void
Core_dealloc(Core *c)
{
    if (c->has_view)
        PyBuffer_Release(&c->view);
    Py_XDECREF(c->payload);
    Py_XDECREF(c->ring);
    Py_XDECREF(c->spare[0]);
    Py_XDECREF(c->spare[1]);
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
    {"try_token", (PyCFunction)Core_try_token, METH_O,
     "try_token(full): take a semaphore token now, if there is one"},
    {"interrupt", (PyCFunction)Core_interrupt, METH_NOARGS,
     "interrupt(): wake this process's waiters on this end; later waits return at once"},
    {"resume", (PyCFunction)Core_resume, METH_NOARGS, "resume(): waits block again"},
    {"wait_unblocked", (PyCFunction)Core_wait_unblocked, METH_O,
     "wait_unblocked(timeout): True once no thread of this process waits on this end"},
    {"forget_wakes", (PyCFunction)Core_forget_wakes, METH_NOARGS,
     "forget_wakes(): the semaphores were emptied (Ring.reset)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Core_members[] = {
    {"producer", T_INT, offsetof(Core, producer), 0, "this process has taken the producer role"},
    {"consumer", T_INT, offsetof(Core, consumer), 0, "this process has taken the consumer role"},
    {"closed", T_INT, offsetof(Core, closed), 0, "the Ring is closed in this process"},
    {"check_s", T_DOUBLE, offsetof(Core, check_s), 0,
     "a wait is cut after this many seconds to check the peer (0: no peer)"},
    {"interrupted", T_INT, offsetof(Core, interrupted), READONLY,
     "interrupt() was called and resume() not since"},
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

/* -- the C API for other extensions (shm/_ringcore.h) ------------------------
 *
 * The end of a Ring.c_handle() (a Core), operated on without waiting, without
 * calling into Python and without raising: the common case or nothing.
 */

static ShmRingEnd *
api_end(PyObject *handle)
{
    if (!PyObject_TypeCheck(handle, &CoreType)) {
        PyErr_Format(PyExc_TypeError, "expected a ring handle (Ring.c_handle()), got %.80s",
                     Py_TYPE(handle)->tp_name);
        return NULL;
    }
    return (ShmRingEnd *)handle;
}

static int64_t
api_slot_size(ShmRingEnd *end)
{
    return ((Core *)end)->slot_size;
}

static int
api_take_readable(ShmRingEnd *end, char **payload, int64_t *nbytes, int64_t *tag)
{
    Core *c = (Core *)end;
    volatile int64_t *w = c->w;
    int64_t slot;
    if (c->closed || !c->consumer || w[W_INVALID] || w[W_RELEASED] != w[W_ACQUIRED]
        || w[W_PUBLISHED] == w[W_ACQUIRED] || banked(c, c->full_sem)
        || !try_token(c, c->full_sem))
        return 0;
    if ((slot = next_readable(c, w[W_ACQUIRED], nbytes)) < 0) {
        sem_post(c->full_sem);   /* a header the Python path reports */
        return 0;
    }
    *payload = slot_payload(c, slot);
    *tag = slot_words(c, slot)[2];
    return 1;
}

static void
api_untake_readable(ShmRingEnd *end)
{
    sem_post(((Core *)end)->full_sem);
}

static void
api_consume(ShmRingEnd *end)
{
    consume((Core *)end);
}

static int
api_take_writable(ShmRingEnd *end, char **payload)
{
    Core *c = (Core *)end;
    volatile int64_t *w = c->w;
    if (c->closed || !c->producer || w[W_INVALID] || w[W_HELD] || banked(c, c->free_sem)
        || !try_token(c, c->free_sem))
        return 0;
    if (surplus_free(c))   /* dropped (see surplus_free): the caller's slow path waits */
        return 0;
    *payload = slot_payload(c, w[W_PUBLISHED] % c->num_slots);
    return 1;
}

static void
api_untake_writable(ShmRingEnd *end)
{
    sem_post(((Core *)end)->free_sem);
}

static void
api_publish(ShmRingEnd *end, int64_t nbytes, int64_t tag)
{
    publish_slot((Core *)end, nbytes, tag);
}

static int
api_quiet(ShmRingEnd *end)
{
    Core *c = (Core *)end;
    return !c->closed && !c->w[W_INVALID] && c->w[W_PUBLISHED] == c->w[W_ACQUIRED];
}

static const ShmRingAPI ring_api = {
    .version = SHM_RING_API_VERSION,
    .end = api_end,
    .slot_size = api_slot_size,
    .take_readable = api_take_readable,
    .untake_readable = api_untake_readable,
    .consume = api_consume,
    .take_writable = api_take_writable,
    .untake_writable = api_untake_writable,
    .publish = api_publish,
    .quiet = api_quiet,
};

/* address(buffer) -> the address of its first byte (shm.buffer_address) */
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

/* stream_copy(dst, src, start, stop): dst[start:stop] = src[start:stop], two byte buffers
 * of one length, written with non-temporal stores (past the caches: a large transfer is
 * read next by another process, on another core, or later than the caches keep it; a
 * store that misses the cache then costs no read of the line first). The GIL is released
 * meanwhile (shm/copy.py's helper copies other chunks). Without SSE2: memcpy. */
static PyObject *
stream_copy(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "stream_copy(dst, src, start, stop): expected 4 "
                     "arguments, got %zd", nargs);
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[2]), stop = PyLong_AsSsize_t(args[3]);
    if ((start == -1 || stop == -1) && PyErr_Occurred())
        return NULL;
    Py_buffer d, r;
    if (PyObject_GetBuffer(args[0], &d, PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &r, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    if (d.len != r.len || start < 0 || stop < start || stop > d.len) {
        PyErr_Format(PyExc_ValueError, "stream_copy: expected two buffers of one length and "
                     "0 <= start <= stop <= length; got lengths %zd and %zd, [%zd, %zd)",
                     d.len, r.len, start, stop);
        PyBuffer_Release(&d);
        PyBuffer_Release(&r);
        return NULL;
    }
    char *dst = (char *)d.buf + start;
    const char *src = (const char *)r.buf + start;
    size_t n = (size_t)(stop - start);
    Py_BEGIN_ALLOW_THREADS
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), e);
    }
    _mm_sfence();   /* the streamed stores are seen before anything written after */
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&d);
    PyBuffer_Release(&r);
    Py_RETURN_NONE;
}

/* plain_arrays(arrays, plan) -> bool: `arrays` is a dict (exactly) of len(plan) items
 * and, for each (key, type, format, shape) of the tuple `plan`, arrays[key] is of type
 * `type` exactly (not a subclass) and exports a buffer of that struct `format` (bytes)
 * and that `shape` (a tuple of ints), contiguous or not. The check of the common
 * request (host_runtime.runner._intake), written in C since it runs before each. */
static PyObject *
plain_arrays(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "plain_arrays(arrays, plan: tuple)");
        return NULL;
    }
    PyObject *arrays = args[0], *plan = args[1];
    Py_ssize_t n = PyTuple_GET_SIZE(plan);
    if (!PyDict_CheckExact(arrays) || PyDict_GET_SIZE(arrays) != n)
        Py_RETURN_FALSE;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *e = PyTuple_GET_ITEM(plan, k);
        if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 4 || !PyBytes_Check(PyTuple_GET_ITEM(e, 2))
            || !PyTuple_Check(PyTuple_GET_ITEM(e, 3))) {
            PyErr_SetString(PyExc_TypeError, "plain_arrays: a plan entry is (key, type, "
                            "format: bytes, shape: tuple)");
            return NULL;
        }
        PyObject *v = PyDict_GetItemWithError(arrays, PyTuple_GET_ITEM(e, 0));
        if (v == NULL) {
            if (PyErr_Occurred())
                return NULL;
            Py_RETURN_FALSE;
        }
        if ((PyObject *)Py_TYPE(v) != PyTuple_GET_ITEM(e, 1))
            Py_RETURN_FALSE;
        Py_buffer b;
        if (PyObject_GetBuffer(v, &b, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
            PyErr_Clear();
            Py_RETURN_FALSE;
        }
        PyObject *shape = PyTuple_GET_ITEM(e, 3);
        int same = b.format != NULL && strcmp(b.format, PyBytes_AS_STRING(PyTuple_GET_ITEM(e, 2))) == 0
                   && b.ndim == PyTuple_GET_SIZE(shape);
        for (int d = 0; same && d < b.ndim; d++)
            same = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, d)) == b.shape[d];
        PyBuffer_Release(&b);
        if (PyErr_Occurred())
            return NULL;
        if (!same)
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* write_arrays(arrays, plan, tag) -> int: for each (key, core) of the tuple `plan` in
 * turn, Core.write(arrays[key], tag, 0.0) on the core's fast path (a free slot there at
 * once, the array one C-contiguous buffer); stops at the first entry it cannot write so
 * (a missing key, an array not contiguous, a ring full or in a state of the Python
 * path), which it leaves untouched: the number of entries written. One call for the
 * inputs of a request instead of one each. */
static PyObject *
write_arrays(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "write_arrays(arrays, plan: tuple, tag)");
        return NULL;
    }
    PyObject *arrays = args[0], *plan = args[1];
    if (!PyDict_Check(arrays)) {
        PyErr_SetString(PyExc_TypeError, "write_arrays: arrays must be a dict");
        return NULL;
    }
    int64_t tag = PyLong_AsLongLong(args[2]);
    if (tag == -1 && PyErr_Occurred())
        return NULL;
    static PyObject *no_wait = NULL;   /* the timeout 0.0 */
    if (no_wait == NULL && (no_wait = PyFloat_FromDouble(0.0)) == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(plan), k;
    for (k = 0; k < n; k++) {
        PyObject *e = PyTuple_GET_ITEM(plan, k);
        if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 2
            || !PyObject_TypeCheck(PyTuple_GET_ITEM(e, 1), &CoreType)) {
            PyErr_SetString(PyExc_TypeError, "write_arrays: a plan entry is (key, Core)");
            return NULL;
        }
        PyObject *v = PyDict_GetItemWithError(arrays, PyTuple_GET_ITEM(e, 0));
        if (v == NULL) {
            if (PyErr_Occurred())
                return NULL;
            break;
        }
        Py_buffer b;
        if (PyObject_GetBuffer(v, &b, PyBUF_SIMPLE) < 0) {
            PyErr_Clear();
            break;
        }
        Core *c = (Core *)PyTuple_GET_ITEM(e, 1);
        int code;
        double first;
        int done = write_fast(c, &b, tag, no_wait, &code, &first);
        PyBuffer_Release(&b);
        if (!done) {
            if (code == FAILED || (code == TOKEN && bank(c, c->free_sem) < 0))
                return NULL;
            break;   /* the token taken is banked: the Python path's write finds it */
        }
    }
    return PyLong_FromSsize_t(k);
}

static PyMethodDef module_methods[] = {
    {"address", (PyCFunction)address, METH_O,
     "address(buffer): the address of a C-contiguous buffer's first byte."},
    {"plain_arrays", (PyCFunction)(void (*)(void))plain_arrays, METH_FASTCALL,
     "plain_arrays(arrays, plan): whether a dict of arrays matches a plan of (key, type, "
     "format, shape) exactly."},
    {"write_arrays", (PyCFunction)(void (*)(void))write_arrays, METH_FASTCALL,
     "write_arrays(arrays, plan, tag): Core.write of each array of a plan of (key, core) "
     "on the fast path, until one cannot be; the number written."},
    {"stream_copy", (PyCFunction)(void (*)(void))stream_copy, METH_FASTCALL,
     "stream_copy(dst, src, start, stop): dst[start:stop] = src[start:stop] with "
     "non-temporal stores, without the GIL."},
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
    if (PyType_Ready(&CoreType) < 0)
        return NULL;
    if (pthread_atfork(before_fork, after_fork_parent, after_fork_child) != 0)
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
    PyObject *capsule = PyCapsule_New((void *)&ring_api, SHM_RING_API_CAPSULE, NULL);
    if (capsule == NULL || PyModule_AddObject(m, "_C_API", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "GENERAL", GENERAL);
    PyModule_AddIntConstant(m, "NO_TOKEN", NO_TOKEN);
    PyModule_AddIntConstant(m, "TOKEN", TOKEN);
    return m;
}

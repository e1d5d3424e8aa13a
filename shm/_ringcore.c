/*
 * shm._ringcore: the hot paths of shm.Ring in C.
 *
 * The ring's layout, protocol and memory-ordering argument are those drawn at
 * the top of shm/ring.py; this file implements the same steps with the same
 * two POSIX semaphores (opened here by name with sem_open, which glibc maps
 * to the same pages as posix_ipc's handle), so a process using this module
 * and a process using the pure-Python path interoperate on one ring.
 *
 * Each method does the common case completely, or nothing that the Python
 * path could not finish, and says which by its return value:
 *
 *   GENERAL  (-1)  nothing was done: run the Python path from the start
 *                  (held slot, invalid ring, bad argument, unusual state);
 *   NO_TOKEN (-2)  nothing was done but a wait of `first` seconds for the
 *                  semaphore came back empty: Python goes on waiting
 *                  (Ring._wait_slow) and then finishes the operation;
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
    PyObject *payload; /* list of per-slot payload memoryviews */
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
    for (;;) {
        struct timespec ts;
        int r, err;
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

static int
parse_first(PyObject *arg, double *first)
{
    *first = PyFloat_AsDouble(arg);
    return (*first == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* -- methods ------------------------------------------------------------ */

/* write(data, tag, first) -> 0 | GENERAL | NO_TOKEN | TOKEN */
static PyObject *
Core_write(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "write(data, tag, first)");
        return NULL;
    }
    volatile int64_t *w = c->w;
    if (w[W_INVALID] || w[W_HELD])
        return PyLong_FromLong(GENERAL);
    int64_t tag = PyLong_AsLongLong(args[1]);
    double first;
    if ((tag == -1 && PyErr_Occurred()) || parse_first(args[2], &first) < 0)
        return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        return PyLong_FromLong(GENERAL);
    }
    if (b.len > c->slot_size) {
        PyBuffer_Release(&b);
        return PyLong_FromLong(GENERAL);
    }
    int r = take(c, c->free_sem, first);
    if (r != 0) {
        PyBuffer_Release(&b);
        return r == FAILED ? NULL : PyLong_FromLong(r);
    }
    if (w[W_INVALID]) {
        PyBuffer_Release(&b);
        return PyLong_FromLong(TOKEN);
    }
    int64_t k = w[W_PUBLISHED];
    int64_t i = k % c->num_slots;
    copy_in(slot_payload(c, i), b.buf, b.len);
    volatile int64_t *s = slot_words(c, i);
    s[0] = k + 1;
    s[1] = b.len;
    s[2] = tag;
    PyBuffer_Release(&b);
    w[W_PUBLISHED] = k + 1;
    sem_post(c->full_sem);
    return PyLong_FromLong(0);
}

/* acquire_write(first) -> slot index | GENERAL | NO_TOKEN | TOKEN */
static PyObject *
Core_acquire_write(Core *c, PyObject *arg)
{
    volatile int64_t *w = c->w;
    if (w[W_INVALID] || w[W_HELD])
        return PyLong_FromLong(GENERAL);
    double first;
    if (parse_first(arg, &first) < 0)
        return NULL;
    int r = take(c, c->free_sem, first);
    if (r != 0)
        return r == FAILED ? NULL : PyLong_FromLong(r);
    if (w[W_INVALID])
        return PyLong_FromLong(TOKEN);
    w[W_HELD] = 1;
    return PyLong_FromLongLong(w[W_PUBLISHED] % c->num_slots);
}

/* publish(nbytes, tag) -> 0 | GENERAL */
static PyObject *
Core_publish(Core *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "publish(nbytes, tag)");
        return NULL;
    }
    volatile int64_t *w = c->w;
    int64_t nbytes = PyLong_AsLongLong(args[0]);
    int64_t tag = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return PyLong_FromLong(GENERAL);
    }
    if (!w[W_HELD] || nbytes < 0 || nbytes > c->slot_size)
        return PyLong_FromLong(GENERAL);
    int64_t k = w[W_PUBLISHED];
    volatile int64_t *s = slot_words(c, k % c->num_slots);
    s[0] = k + 1;
    s[1] = nbytes;
    s[2] = tag;
    w[W_PUBLISHED] = k + 1;
    w[W_HELD] = 0;
    sem_post(c->full_sem);
    return PyLong_FromLong(0);
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

/* acquire_read(first) -> (view, tag) | GENERAL | NO_TOKEN | TOKEN */
static PyObject *
Core_acquire_read(Core *c, PyObject *arg)
{
    volatile int64_t *w = c->w;
    if (w[W_INVALID])
        return PyLong_FromLong(GENERAL);
    double first;
    if (parse_first(arg, &first) < 0)
        return NULL;
    int r = take(c, c->full_sem, first);
    if (r != 0)
        return r == FAILED ? NULL : PyLong_FromLong(r);
    int64_t nbytes = 0;
    int64_t k = w[W_ACQUIRED];
    int64_t i = w[W_INVALID] ? -1 : next_readable(c, k, &nbytes);
    if (i < 0)
        return PyLong_FromLong(TOKEN);
    PyObject *mv = PyList_GET_ITEM(c->payload, i);
    PyObject *view;
    PyObject *stop = PyLong_FromLongLong(nbytes);
    if (stop == NULL)
        return NULL;
    PyObject *sl = PySlice_New(NULL, stop, NULL);
    Py_DECREF(stop);
    if (sl == NULL)
        return NULL;
    view = PyObject_GetItem(mv, sl);
    Py_DECREF(sl);
    if (view == NULL)
        return NULL;
    int64_t tag = slot_words(c, i)[2];
    w[W_ACQUIRED] = k + 1;
    PyObject *out = PyTuple_New(2);
    PyObject *t = PyLong_FromLongLong(tag);
    if (out == NULL || t == NULL) {
        Py_XDECREF(out);
        Py_XDECREF(t);
        Py_DECREF(view);
        return NULL;
    }
    PyTuple_SET_ITEM(out, 0, view);
    PyTuple_SET_ITEM(out, 1, t);
    return out;
}

/* release() -> 0 | GENERAL */
static PyObject *
Core_release(Core *c, PyObject *Py_UNUSED(ignored))
{
    volatile int64_t *w = c->w;
    int64_t k = w[W_RELEASED];
    if (k >= w[W_ACQUIRED])
        return PyLong_FromLong(GENERAL);
    w[W_RELEASED] = k + 1;
    sem_post(c->free_sem);
    return PyLong_FromLong(0);
}

/* read(first) -> (bytes, tag) | GENERAL | NO_TOKEN | TOKEN */
static PyObject *
Core_read(Core *c, PyObject *arg)
{
    volatile int64_t *w = c->w;
    int64_t k = w[W_RELEASED];
    if (k != w[W_ACQUIRED] || w[W_INVALID])
        return PyLong_FromLong(GENERAL);
    double first;
    if (parse_first(arg, &first) < 0)
        return NULL;
    int r = take(c, c->full_sem, first);
    if (r != 0)
        return r == FAILED ? NULL : PyLong_FromLong(r);
    int64_t nbytes = 0;
    int64_t i = w[W_INVALID] ? -1 : next_readable(c, k, &nbytes);
    if (i < 0)
        return PyLong_FromLong(TOKEN);
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
    w[W_ACQUIRED] = k + 1;
    w[W_RELEASED] = k + 1;
    sem_post(c->free_sem);
    PyObject *t = PyLong_FromLongLong(tag);
    PyObject *out = t == NULL ? NULL : PyTuple_New(2);
    if (out == NULL) {
        Py_XDECREF(t);
        Py_DECREF(data);
        return NULL;
    }
    PyTuple_SET_ITEM(out, 0, data);
    PyTuple_SET_ITEM(out, 1, t);
    return out;
}

/* -- type --------------------------------------------------------------- */

static int
Core_init(Core *c, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer", "payload", "free_name", "full_name", "slot_size",
                             "num_slots", "stride", "spin_max_ns", "spin_min_ns", NULL};
    PyObject *buffer, *payload;
    const char *free_name, *full_name;
    long long slot_size, num_slots, stride, spin_max, spin_min;
    if (c->has_view) {
        PyErr_SetString(PyExc_RuntimeError, "Core is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!ssLLLLL", kwlist, &buffer, &PyList_Type,
                                     &payload, &free_name, &full_name, &slot_size, &num_slots,
                                     &stride, &spin_max, &spin_min))
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
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyMethodDef Core_methods[] = {
    {"write", (PyCFunction)(void (*)(void))Core_write, METH_FASTCALL,
     "write(data, tag, first): copy data into the next slot and publish it."},
    {"acquire_write", (PyCFunction)Core_acquire_write, METH_O,
     "acquire_write(first): the index of the slot acquired for writing."},
    {"publish", (PyCFunction)(void (*)(void))Core_publish, METH_FASTCALL,
     "publish(nbytes, tag): publish the acquired slot."},
    {"acquire_read", (PyCFunction)Core_acquire_read, METH_O,
     "acquire_read(first): (view, tag) of the next published slot."},
    {"release", (PyCFunction)Core_release, METH_NOARGS,
     "release(): give the oldest acquired slot back."},
    {"read", (PyCFunction)Core_read, METH_O,
     "read(first): (bytes, tag) of the next message, its slot released."},
    {NULL, NULL, 0, NULL},
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
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "GENERAL", GENERAL);
    PyModule_AddIntConstant(m, "NO_TOKEN", NO_TOKEN);
    PyModule_AddIntConstant(m, "TOKEN", TOKEN);
    return m;
}

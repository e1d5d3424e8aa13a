/*
 * ipu_emulator.ipu._stepcore: one Main iteration of the IPU process in one C call.
 *
 * This file decides nothing: what each stream of an iteration does, and what
 * each slot tag means, is the plan of ipu_emulator/ipu/_iteration.py, handed
 * to Step() as data; this code executes it over the rings through the C API
 * of shm._ringcore (shm/_ringcore.h), and calls a Python function (the
 * interpreter's bound onnxruntime run) between taking the transfers and
 * publishing them.
 *
 * Step(inputs, outputs, table, calls, seq_shift=0).run(seq=0) -> bool; .seq: the
 * sequence number of the iteration of the last step done (0: none), for the outputs of
 * that iteration the Python path writes after the step (streams outside its group)
 *
 *   inputs   tuple of (ring handle, nbytes, accepts): the ring end this process
 *            consumes from (Ring.c_handle()), the bytes of one transfer, and
 *            ((tag, action), ...) saying what a slot of each tag is:
 *              IN_SLOT   the transfer is the slot's payload (exactly nbytes);
 *              IN_TABLE  the payload's bytes are a key of `table`, whose value
 *                        (input memoryview of nbytes, ((output key, memoryview), ...))
 *                        gives the input's memory and redirects the outputs
 *                        of those keys into those memories;
 *            a slot of any other tag (or size) is not done here;
 *   outputs  tuple of (ring handle, nbytes, key, slot_tag, redirect_tag, numbered):
 *            the ring end this process produces into, the bytes of one transfer,
 *            the key table entries name it by, and the tags it is published with:
 *            nbytes of payload tagged slot_tag, or (redirected) 0 bytes tagged
 *            redirect_tag; numbered: whether the tag carries the sequence number
 *            (0 for a stream whose transfers belong to no request, e.g. a token);
 *   table    dict, read at each run (the caller fills it);
 *   calls    dict (input addresses..., output addresses...) -> (any, fn, args),
 *            read at each run: fn(*args) computes the outputs from the inputs
 *            at those addresses;
 *   seq_shift a slot's tag is kind | seq << seq_shift (ipu_emulator.ipu_protocol):
 *            accepts name kinds; the inputs of one run must carry one sequence
 *            number (0, "not numbered", agrees with any; `seq` given to run() is
 *            the number the iteration already has), and every output is tagged
 *            with it. 0: tags are compared whole and outputs carry no number.
 *
 * run(): take one transfer of each input and a free slot of each output
 * (output j's memory is its slot, or the memory a table entry redirected it
 * to), call fn(*args) for the addresses, publish the outputs, consume the
 * inputs: True. False, with every ring as it was (the tokens taken are given
 * back), when anything is not there at once or not as the plan says (a ring
 * empty, full, closed, invalid, in a state of the Python path; a tag not
 * accepted, inputs whose numbers disagree, a size, a table entry or an
 * address key not there): the caller
 * then does the iteration on the Python path, which waits, reports and fills
 * the tables. If fn raises, the inputs are consumed, the outputs given back
 * unpublished, and the exception propagates.
 *
 * A Step holds references to its ring handles (and so to the rings' mappings).
 *
 * trace(buffer, code): from now on each step done writes one record into the
 * trace buffer `buffer` (a writable buffer laid out as shm/tracebuf.py says: a
 * 64-byte header whose capacity is at offset 8 and whose count of records written
 * is at offset 24, then records of 48 bytes): ts = CLOCK_MONOTONIC ns once its inputs
 * were taken, dur until just before its outputs are published (so the host sees them
 * after the step's end), code, tid 0, a = the iteration's sequence number, b / c = ns
 * from ts until the output slots were taken / until fn returned. The GIL is held while a
 * record is written, as it is by the Python writer of the same buffer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stdint.h>
#include <string.h>
#include <time.h>

#include "_ringcore.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define STEP_MAX 16   /* streams of each direction */
#define ACCEPT_MAX 8  /* tags an input accepts */

#define IN_SLOT 1
#define IN_TABLE 2

static const ShmRingAPI *ring;

typedef struct {
    PyObject *handle;
    ShmRingEnd *end;
    int64_t nbytes;
    int n_accept;
    int64_t accept_tag[ACCEPT_MAX];
    int accept_action[ACCEPT_MAX];
} StepIn;

typedef struct {
    PyObject *handle;
    ShmRingEnd *end;
    int64_t nbytes;
    PyObject *key;
    int64_t slot_tag;
    int64_t redirect_tag;
    int numbered;
} StepOut;

typedef struct {
    PyObject_HEAD
    int n_in;
    int n_out;
    StepIn in[STEP_MAX];
    StepOut out[STEP_MAX];
    PyObject *table; /* dict */
    PyObject *calls; /* dict */
    int seq_shift;   /* 0: tags carry no sequence number */
    int64_t kind_mask;
    long long seq;   /* the sequence number of the last step done (its `seq` attribute) */
    int tracing;     /* trace is a buffer held (see trace()) */
    uint32_t trace_code;
    uint32_t trace_capacity;
    Py_buffer trace;
} Step;

#define TRACE_HEADER 64
#define TRACE_RECORD 48
#define TRACE_CAPACITY_AT 8
#define TRACE_COUNT_AT 24

static int64_t
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* One record of a step into the trace buffer (the oldest is overwritten when full). */
static void
trace_record(Step *st, int64_t ts, int64_t dur, int64_t a, int64_t b, int64_t c)
{
    char *base = (char *)st->trace.buf;
    uint64_t n;
    uint32_t tid = 0;
    memcpy(&n, base + TRACE_COUNT_AT, 8);
    char *r = base + TRACE_HEADER + (n % st->trace_capacity) * TRACE_RECORD;
    memcpy(r, &ts, 8);
    memcpy(r + 8, &dur, 8);
    memcpy(r + 16, &st->trace_code, 4);
    memcpy(r + 20, &tid, 4);
    memcpy(r + 24, &a, 8);
    memcpy(r + 32, &b, 8);
    memcpy(r + 40, &c, 8);
    n++;
    memcpy(base + TRACE_COUNT_AT, &n, 8);
}

/* The ring end of `handle`, checked to be another than the ones before it and to
 * hold transfers of `nbytes`. */
static ShmRingEnd *
step_end(PyObject *handle, int64_t nbytes, const char *what, Py_ssize_t i, PyObject **seen,
         int n_seen)
{
    ShmRingEnd *end = ring->end(handle);
    if (end == NULL)
        return NULL;
    if (nbytes < 0 || nbytes > ring->slot_size(end)) {
        PyErr_Format(PyExc_ValueError, "Step: %s %zd: transfers of %lld bytes do not fit "
                     "slots of %lld bytes", what, i, (long long)nbytes,
                     (long long)ring->slot_size(end));
        return NULL;
    }
    for (int k = 0; k < n_seen; k++)
        if (seen[k] == handle) {
            PyErr_Format(PyExc_ValueError, "Step: %s %zd is also %s %d", what, i, what, k);
            return NULL;
        }
    return end;
}

static int
step_sequence(PyObject *seq, const char *what, Py_ssize_t width)
{
    if (!PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "Step: %s must be a tuple", what);
        return -1;
    }
    if (PyTuple_GET_SIZE(seq) > STEP_MAX) {
        PyErr_Format(PyExc_ValueError, "Step: at most %d %s, got %zd", STEP_MAX, what,
                     PyTuple_GET_SIZE(seq));
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(seq); i++) {
        PyObject *e = PyTuple_GET_ITEM(seq, i);
        if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != width) {
            PyErr_Format(PyExc_TypeError, "Step: %s %zd must be a tuple of %zd items", what, i,
                         width);
            return -1;
        }
    }
    return 0;
}

static int
Step_init(Step *st, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"inputs", "outputs", "table", "calls", "seq_shift", NULL};
    PyObject *ins, *outs, *table, *calls, *seen[STEP_MAX];
    int seq_shift = 0;
    if (st->calls != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Step is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO!O!|i", kwlist, &ins, &outs, &PyDict_Type,
                                     &table, &PyDict_Type, &calls, &seq_shift))
        return -1;
    if (seq_shift < 0 || seq_shift > 32) {
        PyErr_Format(PyExc_ValueError, "Step: seq_shift must be in 0..32, got %d", seq_shift);
        return -1;
    }
    st->seq_shift = seq_shift;
    st->kind_mask = seq_shift ? ((int64_t)1 << seq_shift) - 1 : -1;
    if (step_sequence(ins, "inputs", 3) < 0 || step_sequence(outs, "outputs", 6) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ins); i++) {
        PyObject *e = PyTuple_GET_ITEM(ins, i), *accepts = PyTuple_GET_ITEM(e, 2);
        StepIn *s = &st->in[i];
        s->nbytes = PyLong_AsLongLong(PyTuple_GET_ITEM(e, 1));
        if (s->nbytes == -1 && PyErr_Occurred())
            return -1;
        if ((s->end = step_end(PyTuple_GET_ITEM(e, 0), s->nbytes, "inputs", i, seen,
                               st->n_in)) == NULL)
            return -1;
        if (!PyTuple_Check(accepts) || PyTuple_GET_SIZE(accepts) > ACCEPT_MAX) {
            PyErr_Format(PyExc_TypeError, "Step: inputs %zd: accepts must be a tuple of at "
                         "most %d (tag, action) pairs", i, ACCEPT_MAX);
            return -1;
        }
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(accepts); k++) {
            PyObject *p = PyTuple_GET_ITEM(accepts, k);
            long long tag, action;
            if (!PyTuple_Check(p) || !PyArg_ParseTuple(p, "LL", &tag, &action)) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_TypeError, "Step: inputs %zd: accepts must be "
                                 "(tag, action) pairs", i);
                return -1;
            }
            if (action != IN_SLOT && action != IN_TABLE) {
                PyErr_Format(PyExc_ValueError, "Step: inputs %zd: action %lld is not IN_SLOT "
                             "or IN_TABLE", i, action);
                return -1;
            }
            s->accept_tag[k] = tag;
            s->accept_action[k] = (int)action;
        }
        s->n_accept = (int)PyTuple_GET_SIZE(accepts);
        s->handle = seen[i] = PyTuple_GET_ITEM(e, 0);
        Py_INCREF(s->handle);
        st->n_in = (int)(i + 1);
    }
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(outs); j++) {
        PyObject *e = PyTuple_GET_ITEM(outs, j);
        StepOut *s = &st->out[j];
        s->nbytes = PyLong_AsLongLong(PyTuple_GET_ITEM(e, 1));
        s->slot_tag = PyLong_AsLongLong(PyTuple_GET_ITEM(e, 3));
        s->redirect_tag = PyLong_AsLongLong(PyTuple_GET_ITEM(e, 4));
        s->numbered = PyObject_IsTrue(PyTuple_GET_ITEM(e, 5));
        if (s->numbered < 0 || PyErr_Occurred())
            return -1;
        if ((s->end = step_end(PyTuple_GET_ITEM(e, 0), s->nbytes, "outputs", j, seen + st->n_in,
                               st->n_out)) == NULL)
            return -1;
        s->handle = seen[st->n_in + j] = PyTuple_GET_ITEM(e, 0);
        Py_INCREF(s->handle);
        s->key = PyTuple_GET_ITEM(e, 2);
        Py_INCREF(s->key);
        st->n_out = (int)(j + 1);
    }
    Py_INCREF(table);
    st->table = table;
    Py_INCREF(calls);
    st->calls = calls;
    return 0;
}

static void
Step_dealloc(Step *st)
{
    for (int i = 0; i < st->n_in; i++)
        Py_DECREF(st->in[i].handle);
    for (int j = 0; j < st->n_out; j++) {
        Py_DECREF(st->out[j].handle);
        Py_DECREF(st->out[j].key);
    }
    Py_XDECREF(st->table);
    Py_XDECREF(st->calls);
    if (st->tracing)
        PyBuffer_Release(&st->trace);
    Py_TYPE(st)->tp_free((PyObject *)st);
}

/* The C-contiguous memory of a memoryview of exactly `size` bytes, or NULL. */
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

/* Input i's table entry for the payload p of nbytes; 0, or -1 (not usable). A Python
 * exception is set only for a failed allocation. Adds the entry to `held`. */
static int
step_table(Step *st, int i, const char *p, int64_t nbytes, char **in_ptr, char **out_ptr,
           int *redirected, PyObject **held, int *n_held)
{
    PyObject *key = PyBytes_FromStringAndSize(p, nbytes);
    if (key == NULL)
        return -1;
    PyObject *got = PyDict_GetItemWithError(st->table, key);
    Py_DECREF(key);
    if (got == NULL || !PyTuple_Check(got) || PyTuple_GET_SIZE(got) != 2)
        return -1;
    PyObject *outs = PyTuple_GET_ITEM(got, 1);
    if ((in_ptr[i] = view_memory(PyTuple_GET_ITEM(got, 0), st->in[i].nbytes, 0)) == NULL
        || !PyTuple_Check(outs))
        return -1;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(outs); k++) {
        PyObject *o = PyTuple_GET_ITEM(outs, k);
        int j = -1;
        if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 2)
            return -1;
        for (int m = 0; m < st->n_out && j < 0; m++) {
            int eq = PyObject_RichCompareBool(st->out[m].key, PyTuple_GET_ITEM(o, 0), Py_EQ);
            if (eq < 0)
                return -1;
            if (eq)
                j = m;
        }
        if (j < 0 || redirected[j])
            return -1;
        out_ptr[j] = view_memory(PyTuple_GET_ITEM(o, 1), st->out[j].nbytes, 1);
        if (out_ptr[j] == NULL)
            return -1;
        redirected[j] = 1;
    }
    Py_INCREF(got);
    held[(*n_held)++] = got;
    return 0;
}

/* One step: 1 (done), 0 (nothing done), -1 (fn raised, or no memory: an exception is set).
 * `seq`: the iteration's sequence number so far (0: none). */
static int
step_once(Step *st, int64_t seq)
{
    char *in_ptr[STEP_MAX], *out_ptr[STEP_MAX];
    int redirected[STEP_MAX] = {0};
    PyObject *held[STEP_MAX];
    int n_held = 0, taken_in = 0, taken_out = 0, i, j, result = 0;
    PyObject *key = NULL;
    int64_t t_start = 0, t_taken = 0, t_computed = 0, t_end = 0;

    for (i = 0; i < st->n_in; i++) {
        StepIn *s = &st->in[i];
        char *payload;
        int64_t nbytes, tag;
        int action = 0;
        if (!ring->take_readable(s->end, &payload, &nbytes, &tag))
            goto undo;
        taken_in++;
        if (st->seq_shift) {
            int64_t n = tag >> st->seq_shift;
            if (n) {
                if (seq && n != seq)
                    goto undo;   /* inputs of two transfers: the Python path reports it */
                seq = n;
            }
            tag &= st->kind_mask;
        }
        for (int k = 0; k < s->n_accept && !action; k++)
            if (s->accept_tag[k] == tag)
                action = s->accept_action[k];
        if (action == IN_SLOT && nbytes == s->nbytes)
            in_ptr[i] = payload;
        else if (action != IN_TABLE
                 || step_table(st, i, payload, nbytes, in_ptr, out_ptr, redirected, held,
                               &n_held) < 0)
            goto undo;
    }
    if (st->tracing)     /* the inputs are there (published before this instant) */
        t_start = now_ns();
    for (j = 0; j < st->n_out; j++) {
        char *payload;
        if (!ring->take_writable(st->out[j].end, &payload))
            goto undo;
        taken_out++;
        if (!redirected[j])
            out_ptr[j] = payload;
    }
    if (st->tracing)
        t_taken = now_ns();
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
            ring->consume(st->in[i].end);
        taken_in = 0;
        result = -1;
        goto undo;
    }
    Py_DECREF(r);
    if (st->tracing)     /* before the publishes: the host sees the outputs after it */
        t_computed = t_end = now_ns();
    int64_t numbered = st->seq_shift ? seq << st->seq_shift : 0;
    for (j = 0; j < st->n_out; j++) {
        StepOut *s = &st->out[j];
        ring->publish(s->end, redirected[j] ? 0 : s->nbytes,
                      (redirected[j] ? s->redirect_tag : s->slot_tag)
                      | (s->numbered ? numbered : 0));
    }
    for (i = 0; i < st->n_in; i++)
        ring->consume(st->in[i].end);
    Py_DECREF(key);
    for (i = 0; i < n_held; i++)
        Py_DECREF(held[i]);
    if (st->tracing)
        trace_record(st, t_start, t_end - t_start, seq, t_taken - t_start,
                     t_computed - t_start);
    st->seq = (long long)seq;
    return 1;
undo:
    /* give back every slot taken: the rings are as before the call */
    for (i = 0; i < taken_in; i++)
        ring->untake_readable(st->in[i].end);
    for (j = 0; j < taken_out; j++)
        ring->untake_writable(st->out[j].end);
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

/* run(seq=0) */
static PyObject *
Step_run(Step *st, PyObject *const *args, Py_ssize_t nargs)
{
    long long seq = 0;
    if (nargs > 1) {
        PyErr_Format(PyExc_TypeError, "run() takes at most 1 argument (%zd given)", nargs);
        return NULL;
    }
    if (nargs == 1 && (seq = PyLong_AsLongLong(args[0])) == -1 && PyErr_Occurred())
        return NULL;
    int r = step_once(st, (int64_t)seq);
    if (r < 0)
        return NULL;
    return PyBool_FromLong(r);
}

/* After a step was done: poll for up to poll_ns (never past `deadline`) until every input
 * has something to read (or is closed or invalid: the next step, or the Python path,
 * sees to it). 1 if so, 0 if the time is up or `watch` has a message. The GIL is held
 * (a few microseconds: the time a host takes to send its next request). */
static int
poll_inputs(Step *st, ShmRingEnd *watch, int64_t poll_ns, int64_t deadline)
{
    int64_t now = now_ns(), end = now + poll_ns;
    if (end > deadline)
        end = deadline;
    for (;;) {
        for (int k = 0; k < 32; k++) {
            int there = 1;
            for (int i = 0; i < st->n_in && there; i++)
                there = !ring->quiet(st->in[i].end);
            if (there)
                return 1;
            if (watch != NULL && !ring->quiet(watch))
                return 0;
#if defined(__SSE2__)
            _mm_pause();
#endif
        }
        if (now_ns() >= end)
            return 0;
    }
}

/* run_many(unit, deadline_ns, watch=None, poll_ns=0) -> steps done: units of `unit` steps
 * back to back, while the monotonic clock is before deadline_ns and the ring end `watch`
 * (a Ring.c_handle() this process consumes from) is open, valid and has nothing to read; a
 * step that cannot be done ends it, even inside a unit (the count then is not a multiple
 * of `unit`). poll_ns: once a unit is done, a unit that cannot start at once is polled
 * for up to poll_ns first (a host sending requests back to back: its next one comes
 * within microseconds, and is taken at once instead of after a return to Python). */
static PyObject *
Step_run_many(Step *st, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"unit", "deadline_ns", "watch", "poll_ns", NULL};
    long long unit, deadline, poll_ns = 0;
    PyObject *watch_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LL|OL:run_many", kwlist, &unit, &deadline,
                                     &watch_obj, &poll_ns))
        return NULL;
    if (unit < 1) {
        PyErr_Format(PyExc_ValueError, "run_many: unit must be at least 1, got %lld", unit);
        return NULL;
    }
    ShmRingEnd *watch = NULL;
    if (watch_obj != Py_None && (watch = ring->end(watch_obj)) == NULL)
        return NULL;
    long long done = 0;
    while (now_ns() < deadline && (watch == NULL || ring->quiet(watch))) {
        for (long long u = 0; u < unit; u++) {
            int r = step_once(st, 0);
            if (r < 0)
                return NULL;
            if (r == 0 && u == 0 && done > 0 && poll_ns > 0
                    && poll_inputs(st, watch, poll_ns, deadline))
                r = step_once(st, 0);
            if (r < 0)
                return NULL;
            if (r == 0)
                return PyLong_FromLongLong(done);
            done++;
        }
    }
    return PyLong_FromLongLong(done);
}

/* trace(buffer, code) */
static PyObject *
Step_trace(Step *st, PyObject *args)
{
    PyObject *obj;
    unsigned int code;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "OI:trace", &obj, &code))
        return NULL;
    if (PyObject_GetBuffer(obj, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    uint32_t capacity = 0;
    if (view.len >= TRACE_HEADER)
        memcpy(&capacity, (char *)view.buf + TRACE_CAPACITY_AT, 4);
    if (capacity == 0 || view.len < TRACE_HEADER + (Py_ssize_t)capacity * TRACE_RECORD) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "trace: a buffer of %zd bytes does not hold the "
                     "header and %u records of a trace buffer", view.len, capacity);
        return NULL;
    }
    if (st->tracing)
        PyBuffer_Release(&st->trace);
    st->trace = view;
    st->trace_code = code;
    st->trace_capacity = capacity;
    st->tracing = 1;
    Py_RETURN_NONE;
}

static PyMethodDef Step_methods[] = {
    {"trace", (PyCFunction)Step_trace, METH_VARARGS,
     "trace(buffer, code): record each step done into a trace buffer (see the C file)."},
    {"run", (PyCFunction)(void (*)(void))Step_run, METH_FASTCALL,
     "run(seq=0) -> True if one step was done, False if nothing was done (see the C file)."},
    {"run_many", (PyCFunction)(void (*)(void))Step_run_many, METH_VARARGS | METH_KEYWORDS,
     "run_many(unit, deadline_ns, watch=None, poll_ns=0) -> steps done back to back (see "
     "the C file)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Step_members[] = {
    {"seq", T_LONGLONG, offsetof(Step, seq), READONLY,
     "The sequence number of the iteration the last step done was part of (0: none): "
     "the Python path tags the iteration's other outputs with it."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject StepType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ipu_emulator.ipu._stepcore.Step",
    .tp_basicsize = sizeof(Step),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One Main iteration over rings in one C call, as a plan says "
              "(see ipu_emulator/ipu/_stepcore.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Step_init,
    .tp_dealloc = (destructor)Step_dealloc,
    .tp_methods = Step_methods,
    .tp_members = Step_members,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ipu_emulator.ipu._stepcore",
    "One Main iteration of the IPU process in one C call, executing a plan of "
    "ipu_emulator.ipu._iteration over shm rings.", -1, NULL,
};

PyMODINIT_FUNC
PyInit__stepcore(void)
{
    ring = (const ShmRingAPI *)PyCapsule_Import(SHM_RING_API_CAPSULE, 0);
    if (ring == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_ImportError)) {   /* e.g. a stale shm._ringcore */
            PyErr_Clear();
            PyErr_SetString(PyExc_ImportError, "shm._ringcore has no C API "
                            "(" SHM_RING_API_CAPSULE "): rebuild the extensions");
        }
        return NULL;
    }
    if (ring->version != SHM_RING_API_VERSION) {
        PyErr_Format(PyExc_ImportError, "shm._ringcore has C API version %d, this module "
                     "was built for %d: rebuild the extensions", ring->version,
                     SHM_RING_API_VERSION);
        return NULL;
    }
    if (PyType_Ready(&StepType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&StepType);
    if (PyModule_AddObject(m, "Step", (PyObject *)&StepType) < 0) {
        Py_DECREF(&StepType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "IN_SLOT", IN_SLOT) < 0
        || PyModule_AddIntConstant(m, "IN_TABLE", IN_TABLE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/*
 * shm/_ringcore.h: the C API of shm._ringcore, for other C extensions.
 *
 * The ring's layout and protocol stay inside shm/_ringcore.c; what crosses is
 * a table of functions over one process's end of a ring, published by
 * shm._ringcore as the capsule SHM_RING_API_CAPSULE (the standard CPython way
 * for one extension to call another):
 *
 *     const ShmRingAPI *api = PyCapsule_Import(SHM_RING_API_CAPSULE, 0);
 *     if (api == NULL || api->version != SHM_RING_API_VERSION) ... fail
 *     ShmRingEnd *end = api->end(handle);   handle = ring.c_handle() in Python
 *
 * `end` is borrowed from `handle`: keep a reference to the handle for as long
 * as the end is used (the handle holds the ring's mapping and semaphores).
 *
 * The operations do the common case or nothing: they never wait, never call
 * into Python and never raise (the GIL must be held, as for any call on the
 * ring from this process). "Nothing" means the caller goes to the Python
 * methods of shm.Ring, which wait, take the process's role on first use,
 * report errors and finish what the C side declined. In particular they act
 * only on an end whose role (consumer: reads; producer: writes) this process
 * has already taken through the Python path, and that is open and valid.
 *
 * Taking is two-phase so that a caller can take from several rings and give
 * everything back if one of them is not ready:
 *
 *   take_readable -> consume (done with it) or untake_readable (as before);
 *   take_writable -> publish (send it)      or untake_writable (as before).
 */
#ifndef SHM_RINGCORE_H
#define SHM_RINGCORE_H

#include <Python.h>
#include <stdint.h>

#define SHM_RING_API_CAPSULE "shm._ringcore._C_API"
#define SHM_RING_API_VERSION 1

typedef struct ShmRingEnd ShmRingEnd; /* opaque: one process's end of a ring */

typedef struct {
    int version; /* SHM_RING_API_VERSION */

    /* The end behind `handle` (a Ring.c_handle()); NULL with a TypeError set if it is
     * not one. */
    ShmRingEnd *(*end)(PyObject *handle);

    /* Payload bytes of a slot. */
    int64_t (*slot_size)(ShmRingEnd *end);

    /* Consumer: take the next published slot if there is one at once (1: *payload,
     * *nbytes and *tag are set, the slot is held), else 0 (nothing taken). */
    int (*take_readable)(ShmRingEnd *end, char **payload, int64_t *nbytes, int64_t *tag);
    /* Give back a slot take_readable took (still unread for the next take). */
    void (*untake_readable)(ShmRingEnd *end);
    /* Done with a slot take_readable took: it is free for the producer. */
    void (*consume)(ShmRingEnd *end);

    /* Producer: take the next free slot if there is one at once (1: *payload is its
     * memory, slot_size bytes), else 0. */
    int (*take_writable)(ShmRingEnd *end, char **payload);
    /* Give back a slot take_writable took, unpublished. */
    void (*untake_writable)(ShmRingEnd *end);
    /* Publish the slot take_writable took: nbytes (<= slot_size) of payload, tagged. */
    void (*publish)(ShmRingEnd *end, int64_t nbytes, int64_t tag);

    /* 1 if the end is open, valid and has nothing to read (a consumer's view), else 0. */
    int (*quiet)(ShmRingEnd *end);
} ShmRingAPI;

#endif /* SHM_RINGCORE_H */

/*
 * The least a PyTorch pluggable allocator can cost: a measuring device for
 * the calls probe (pytorch_compare.py's `floor` allocator), not an
 * allocator to use. Sizes round up to a class (an eighth of a power of
 * two: at most 12.5 % more); for each class it keeps a stack of the
 * blocks freed in it and hands the latest back; a class with none takes
 * fresh bytes from a slab of device memory (cuMemAlloc, 2 GiB at a time,
 * or the request alone when larger; never given back). It ignores
 * streams (the probe launches no work) and frees nothing to the device.
 * So each call is a few shifts and a push or pop: what is left of the
 * probe's time under it is what PyTorch's CUDAPluggableAllocator and the
 * probe's Python loop cost.
 *
 *   cc -O2 -shared -fPIC -o libpluggable_floor.so scripts/pluggable_floor.c -ldl
 *
 * libcuda is opened at run time, as vmpool opens it: nothing links
 * against CUDA at build time. Not thread-safe (the probe calls from one
 * thread).
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>

typedef int (*mem_alloc_fn)(uint64_t *dptr, size_t bytes);

#define SLAB (2ull << 30)
#define ALIGN 512ull
/* Classes: 8 per power of two from ALIGN up to 2^63. */
#define CLASSES (64 * 8)

struct stack {
    void **blocks;
    size_t len, cap;
};

static struct stack table[CLASSES];
static mem_alloc_fn mem_alloc;
static uint64_t slab_next, slab_end;

static void die(const char *what) {
    fprintf(stderr, "pluggable_floor: %s\n", what);
    abort();
}

/* The class of `size` (at least ALIGN), and its bytes in *bytes. */
static size_t class_of(size_t size, size_t *bytes) {
    if (size < ALIGN)
        size = ALIGN;
    int top = 63 - __builtin_clzll(size - 1); /* 2^top < size <= 2^(top+1) */
    size_t step = (1ull << top) >> 3;        /* an eighth of 2^top */
    size_t k = (size - (1ull << top) + step - 1) / step; /* 1..8 */
    *bytes = (1ull << top) + k * step;
    return (size_t)top * 8 + (k - 1);
}

static uint64_t device_alloc(size_t bytes) {
    if (!mem_alloc) {
        void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
        if (!cuda)
            die("cannot open libcuda.so.1");
        mem_alloc = (mem_alloc_fn)dlsym(cuda, "cuMemAlloc_v2");
        if (!mem_alloc)
            die("libcuda has no cuMemAlloc_v2");
    }
    /* PyTorch made the device's primary context current before its first
       allocation. */
    uint64_t ptr;
    if (mem_alloc(&ptr, bytes) != 0)
        die("cuMemAlloc failed");
    return ptr;
}

static void *carve(size_t bytes) {
    if (bytes > SLAB)
        return (void *)(uintptr_t)device_alloc(bytes);
    if (slab_next + bytes > slab_end) {
        /* The old slab's tail is never used. */
        slab_next = device_alloc(SLAB);
        slab_end = slab_next + SLAB;
    }
    void *ptr = (void *)(uintptr_t)slab_next;
    slab_next += bytes;
    return ptr;
}

void *floor_malloc(ssize_t size, int device, void *stream) {
    (void)device;
    (void)stream;
    if (size <= 0)
        return NULL;
    size_t bytes;
    struct stack *s = &table[class_of((size_t)size, &bytes)];
    if (s->len)
        return s->blocks[--s->len];
    return carve(bytes);
}

void floor_free(void *ptr, ssize_t size, int device, void *stream) {
    (void)device;
    (void)stream;
    if (!ptr)
        return;
    size_t bytes;
    struct stack *s = &table[class_of((size_t)size, &bytes)];
    if (s->len == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 16;
        s->blocks = realloc(s->blocks, s->cap * sizeof *s->blocks);
        if (!s->blocks)
            die("out of host memory");
    }
    s->blocks[s->len++] = ptr;
}

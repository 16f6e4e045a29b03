/* vmpool's C interface: libvmpool_c.so (cargo build --release -p vmpool-c).
 *
 * A stream-ordered, defragmenting allocator, one pool per device, made on
 * first use. The two allocation functions have the signatures PyTorch's
 * CUDAPluggableAllocator expects.
 *
 * Settings, read from the environment at the first call. A bad value of
 * any of them stops the library: every allocation returns NULL, and the
 * reason is printed on stderr whatever `VMPOOL_LOG` says. Bytes are a
 * number with an optional unit (`512MiB`, `2G`, `1.5GiB`; K, M, G, T with
 * or without `B` or `iB` are powers of 1024) or `max`, as the tools' size
 * options take them.
 *
 * | variable | meaning | default |
 * | --- | --- | --- |
 * | `VMPOOL_RELEASE_THRESHOLD` | bytes a pool keeps across a synchronize | `max` (keep everything, as PyTorch does) |
 * | `VMPOOL_CHUNK_SIZE` | largest growth chunk, in bytes | `32MiB` |
 * | `VMPOOL_CHUNK_DIVISOR` | growth chunks of at most the pool's reserved bytes over this, within one granule and `VMPOOL_CHUNK_SIZE`; `off`: whole `VMPOOL_CHUNK_SIZE` chunks, more footprint but memory that streams at native's speed (in 2 MiB chunks 0.5-4 % slower: docs/RESULTS.md, "Memory in 2 MiB chunks streams slower") | `1024` (the Rust library's is 2048) |
 * | `VMPOOL_GRANULE_GROWTH_BELOW` | with a divisor, grow by one-granule (2 MiB) chunks while the pool holds fewer bytes than this, and up to 16 GiB until the second step mark; `0`: the divisor alone | `2G` |
 * | `VMPOOL_VA_SIZE` | address space the device's pool reserves, in bytes; more for a marked program that builds one model after another on one pool, whose layouts walk up it (docs/RESULTS.md, "Layouts that walk the address space") | four times the device's memory |
 * | `VMPOOL_FRESH_START` | what a pool does once the program has emptied it: `when-emptied` lays out the next work as from empty, on its own chunks parked in place, so that repeated work keeps its first footprint; `never` keeps the last work's layout, which grows less but whose footprint may creep (docs/RESULTS.md, "Fresh starts that keep their chunks mapped") | `when-emptied` |
 * | `VMPOOL_HANDLE_TYPE` | `posix_fd`: every pool's chunks exportable as POSIX descriptors, so that NCCL can register its memory (`vmpool.torch.register`); `none`: not shareable | `none` |
 * | `VMPOOL_TIMING` | `1`: time every `vmpool_alloc` / `vmpool_free` and report it in `vmpool_stats` (`timed_calls`, `call_nanos`, `timed_frees`, `free_nanos`) | `0` |
 * | `VMPOOL_LOG` | log filter, to stderr (`info`, `vmpool=debug`, `off`, ...); failures are logged at level error | `warn` |
 * | `VMPOOL_RECORD` | path prefix: each pool records its trace there, written out by `vmpool_flush_traces` (`vmpool_torch.py` calls it at exit) | off |
 * | `VMPOOL_BACKEND` | `cuda`, or `host` (memfd chunks; no GPU) for tests | `cuda` |
 * | `VMPOOL_HOST_DEVICES` | the host backend's devices | `1` |
 * | `VMPOOL_HOST_MEMORY` | the host backend's memory per device, in bytes | `4G` |
 * | `VMPOOL_LIB` | where the Python package finds the library (read by the package only; `VMPOOL_ALLOW_MISMATCH=1` warns instead of refusing another version) | in the package, then `target/release/` |
 * | `VMPOOL_MARK_STEPS` | `0`: `vmpool.torch.install()` marks no step at optimizer steps (read by the Python package only; `install(mark_steps=...)` wins) | `1` (a step marked after each `torch.optim` optimizer's `step()`) |
 *
 * Streams: `stream` is a CUstream / cudaStream_t of the device's primary
 * context (the runtime API's contexts), or 0 for the legacy default stream.
 * It must stay alive while allocations freed on it may be pending (until
 * vmpool_synchronize, or forever for streams that are never destroyed,
 * such as PyTorch's). To destroy a stream vmpool has seen, call
 * vmpool_synchronize (or vmpool_empty_cache) between its last use and its
 * destruction: they wait for every stream and then forget them all, so a
 * handle that comes back as another stream is adopted as a new one, not
 * taken for the old one with the order vmpool knew it to have. The
 * per-thread default stream is refused.
 */
#ifndef VMPOOL_H
#define VMPOOL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* `size` bytes on `device`, usable in stream order on `stream`. NULL for
 * size 0, and on failure (out of memory, bad arguments: logged). */
void *vmpool_alloc(ssize_t size, int device, void *stream);

/* Frees `ptr` in stream order on `stream`: the memory is reused once the
 * work queued on `stream` so far has run. NULL is ignored. `size`, when not
 * negative, is compared with the allocation's: another size is logged as a
 * warning, and the allocation is freed all the same. A pointer vmpool did
 * not hand out (never, or not any more: a double free, an interior pointer,
 * a pointer of another device) changes nothing and is counted in
 * vmpool_stats_t.refused_frees; the first 10 refusals of a device are
 * logged in full, after them only a count, when the total reaches 100,
 * 1000, 10000 and so on. */
void vmpool_free(void *ptr, ssize_t size, int device, void *stream);

/* Notes that work queued on `stream` (of the pointer's device) may use
 * `ptr`, a live allocation, until it is freed: vmpool_free then makes its
 * stream wait for the work queued on `stream` up to the free before the
 * memory can be reused (PyTorch's Tensor.record_stream; vmpool_torch.install
 * hooks it). Other streams are not tracked otherwise, as with
 * cudaFreeAsync. A pointer vmpool does not hold live is logged and changes
 * nothing. */
void vmpool_record_stream(void *ptr, void *stream);

/* CUDA graphs. A graph replays into the memory its capture allocated, so
 * that memory must go to nothing else while the graph lives. PyTorch gives
 * each capture a private pool id and calls these hooks around it
 * (vmpool_torch.install sets them); each id gets a vmpool pool of its own.
 * While one is open (begin .. end), an allocation on a stream that is
 * capturing (cuStreamIsCapturing) comes from it; a free goes back to the
 * pool it came from; a pool goes, with its memory, once every graph that
 * captured into it is released (graphs may share one: one release per
 * begin) and its last allocation is freed. A free of an allocation that
 * vmpool_record_stream named other streams for, made while a pool is open,
 * is done when the capture ends. One capture at a time per device: an allocation on
 * a capturing stream while two pools are open fails (NULL, logged).
 * `filter` is PyTorch's stream filter (a C++ object passed by reference);
 * vmpool does not use it. vmpool_trim and the figures of vmpool_stats other
 * than graph_pools and graph_reserved_bytes are the device's pool only. */
typedef struct {
    uint64_t first, second;
} vmpool_mempool_id_t;
void vmpool_begin_allocate_to_pool(int device, vmpool_mempool_id_t pool, const void *filter);
void vmpool_end_allocate_to_pool(int device, vmpool_mempool_id_t pool);
void vmpool_release_pool(int device, vmpool_mempool_id_t pool);

/* Memory pools (torch.cuda.MemPool, torch.cuda.use_mem_pool). An id made a
 * memory pool by vmpool_mem_pool_create gets a vmpool pool of its own, and
 * the three hooks above mean, for it: begin puts the calling thread in it
 * (its allocations on the device, on any stream, come from it: a capturing
 * stream goes to an open graph pool first), end takes the thread out, and
 * release does nothing (use_mem_pool ends with it). One pool at a time per
 * thread and device; a free goes back to the pool it came from, from any
 * thread. vmpool_mem_pool_release lets the pool go with its memory and its
 * address space: when = VMPOOL_RELEASE_NOW is refused while an allocation
 * of it is live, VMPOOL_RELEASE_WITH_LAST_FREE lets it go with the last
 * one. Returns 0 gone, 1 going with its last free, -1 refused (an unknown
 * id, a thread in it, allocations live; logged). vmpool_empty_cache trims
 * memory pools too; vmpool_sleep leaves them awake. vmpool_mem_pool_stats:
 * the pool's own figures (the pool fields of vmpool_stats_t). */
#define VMPOOL_RELEASE_NOW 0
#define VMPOOL_RELEASE_WITH_LAST_FREE 1
int vmpool_mem_pool_create(int device, vmpool_mempool_id_t pool);
int vmpool_mem_pool_release(int device, vmpool_mempool_id_t pool, int when);

/* Waits for every stream vmpool has seen on `device`; then their frees are
 * reusable on every stream, the pool keeps at most its release threshold,
 * and vmpool forgets the streams (it adopts them again at their next use).
 * 0 on success, -1 on failure (logged). */
int vmpool_synchronize(int device);

/* Releases unused physical memory of the device's pool down to `keep`
 * bytes. Frees still pending on a stream count as used until
 * vmpool_synchronize. 0 on success, -1 on failure. */
int vmpool_trim(int device, uint64_t keep);

/* Waits for the streams vmpool has seen on every device (and forgets them,
 * as vmpool_synchronize does) and releases each device's unused memory
 * (PyTorch's torch.cuda.empty_cache; vmpool_torch.install hooks it). CUDA
 * graphs' pools keep theirs. Failures are logged. */
void vmpool_empty_cache(void);

/* What vmpool_sleep at level 1 does with each device pool's bytes:
 * `keep` non-zero keeps them in host memory until vmpool_wake, zero (the
 * default) drops them. 0 / -1 (logged). */
int vmpool_set_retention(int keep);

/* Gives every device pool's memory back while every pointer into it stays
 * valid: level 1 keeps the bytes of pools whose retention keeps them, level
 * 2 keeps nothing. Waits for the streams vmpool has seen first. Until
 * vmpool_wake, allocations return NULL (logged) and work that touches the
 * memory faults; frees are taken, and their bytes are not copied back. CUDA graphs' pools stay awake. Refused
 * during a graph capture. A pool under 2 GiB is made of 2 MiB chunks, and
 * its first sleep pays for releasing each (30-60 us apiece on an H200)
 * unless vmpool_prepare_sleep joined them; VMPOOL_CHUNK_DIVISOR=off grows
 * it by whole chunks instead. 0 / -1 (logged). */
int vmpool_sleep(int level);

/* Gets every device pool ready for a vmpool_sleep at the copy's speed: a
 * sleep that keeps every live byte, then a wake, after which each
 * allocation's memory is few chunks (the driver releases many small ones
 * more slowly than their bytes copy). Pins host memory for the live bytes,
 * as vmpool_reserve_host. Waits for the streams vmpool has seen first;
 * refused during a graph capture. 0 / -1 (logged; a pool the device then
 * lacks memory for stays asleep, to be woken by vmpool_wake). */
int vmpool_prepare_sleep(void);

/* Maps every sleeping pool's memory back at the same addresses and copies
 * the kept bytes back. A pool the device lacks memory for stays asleep,
 * its bytes on the host, to be woken again (the log says how many bytes it
 * needs). 0 / -1 (logged). */
int vmpool_wake(void);

/* Page-locked host memory for the kept bytes stays with the device's pool
 * from one vmpool_sleep to the next, so that only the first sleep pins it
 * (the kernel's work, at a few GB/s: most of a first sleep's time).
 * vmpool_reserve_host makes the pool hold at least `bytes` of it now (0 /
 * -1); vmpool_release_host frees it and returns the bytes freed (-1 on
 * failure). Both are refused while the pool sleeps with bytes kept there.
 * vmpool_stats_t.host_bytes says how much a pool holds. */
int vmpool_reserve_host(int device, uint64_t bytes);
int64_t vmpool_release_host(int device);

/* Limits the device's pool to `fraction` (in (0, 1]) of the device's
 * memory: growth past it fails as out of memory; what the pool holds above
 * it stays until freed and trimmed. CUDA graphs' pools are not limited.
 * PyTorch's torch.cuda.set_per_process_memory_fraction (vmpool_torch.install
 * hooks it). A bad fraction is logged and changes nothing. */
void vmpool_set_memory_fraction(double fraction, int device);

/* Sets the high-water marks to the current values. 0 / -1. */
int vmpool_reset_peaks(int device);

/* Marks the end of a step of a program that repeats its work, on device's
 * pool: once steps repeat, the pool serves them from a layout without
 * driver calls (docs/DESIGN.md, Note [Step layouts]). 0 / -1. */
int vmpool_mark_step(int device);

/* The same at device's pool's next allocation, so that the frees until
 * then belong to the step ending: for a hook that runs before a step's
 * last frees (after an optimizer's step, before its gradients go). 0 / -1. */
int vmpool_mark_step_at_next_alloc(int device);

typedef struct {
    uint64_t valid; /* 0: the call failed (logged) */
    uint64_t reserved_bytes, reserved_high; /* physical memory held, most held */
    uint64_t used_bytes, used_high;         /* live allocations, most live */
    uint64_t allocations, frees, grows;
    uint64_t remaps, bytes_remapped; /* chunks moved instead of created */
    uint64_t chunks_created, chunks_released;
    uint64_t largest_free_range;
    uint64_t pending_bytes; /* freed in stream order, not yet free for all */
    uint64_t refused_frees;
    uint64_t timed_calls, call_nanos; /* VMPOOL_TIMING=1: alloc and free calls, and their time */
    uint64_t graph_pools, graph_reserved_bytes; /* CUDA graphs' private pools, and their memory */
    uint64_t timed_frees, free_nanos; /* of the timed calls, the frees */
    uint64_t grow_nanos;              /* time spent growing: planning and driver calls */
    uint64_t maps, unmaps;            /* driver map and unmap calls */
    uint64_t same_stream_reuses;      /* allocations served without the pool's lock, by the stream's own frees */
    uint64_t frees_merged, frees_completed; /* stream-ordered frees back in the free space: early for their own stream, or once it passed them */
    uint64_t events_recorded, waits_inserted; /* events recorded to learn when frees complete; waits to reuse another stream's */
    uint64_t mem_pools, mem_pool_reserved_bytes, mem_pool_used_bytes; /* memory pools, their memory and live bytes */
    uint64_t host_bytes;              /* page-locked host memory held for sleeping (vmpool_reserve_host) */
    uint64_t steps, step_layouts;     /* steps marked (vmpool_mark_step), layouts made of them */
    uint64_t planned, missed;         /* allocations served from a layout's slot; those that missed theirs */
    uint64_t step_region_bytes;       /* the layouts' regions (in reserved_bytes) */
} vmpool_stats_t;

/* The device's figures; all 0 (with valid = 1) before its first allocation. */
vmpool_stats_t vmpool_stats(int device);
vmpool_stats_t vmpool_mem_pool_stats(int device, vmpool_mempool_id_t pool);

/* Writes the pool's address-space map to stderr. 0 / -1. */
int vmpool_print_snapshot(int device);

/* The same map, copied into `buf` (at most len - 1 bytes and a NUL).
 * Returns the map's full length without the NUL (call again with a larger
 * buffer when it is not less than `len`), 0 when the device has no pool
 * yet, -1 on failure. `buf` may be NULL when `len` is 0. */
ssize_t vmpool_snapshot(int device, char *buf, size_t len);

/* The memory history, for PyTorch's memory snapshots (the Python package
 * turns it into their pickle). vmpool_record_history starts recording
 * afresh (enabled != 0) or stops (what was recorded stays): a ring of the
 * last max_entries allocations, frees, refusals, and maps and unmaps of
 * the pools' units, on devices 0..devices-1 and any other used meanwhile.
 * Off by default. vmpool_history copies the record and the pools of
 * devices 0..devices-1 as JSON into `buf`, as vmpool_snapshot does. */
void vmpool_record_history(int enabled, size_t max_entries, int devices);
ssize_t vmpool_history(int devices, char *buf, size_t len);

/* Writes out the allocation traces being recorded (VMPOOL_RECORD); the
 * pools live until the process ends, so call it before exiting. 0 / -1. */
int vmpool_flush_traces(void);

/* "cuda", "host", or "none" when the library could not start. */
const char *vmpool_backend(void);

/* The library's version ("0.1.0"), the layout of what crosses this
 * interface by value (bumped when a struct or a signature changes), and
 * sizeof(vmpool_stats_t) as built: a caller that mirrors the structs (the
 * Python package) checks them before anything else and refuses a library
 * built for another layout. None of them starts the library. */
const char *vmpool_version(void);
uint32_t vmpool_abi(void);
size_t vmpool_stats_size(void);

#ifdef __cplusplus
}
#endif

#endif /* VMPOOL_H */

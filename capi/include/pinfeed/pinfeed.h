/* pinfeed.h — the C ABI of pinfeed: the loader and the memory diagnostics.
 *
 * Conventions
 * - Every function that can fail returns a pinfeed_status; on failure
 *   pinfeed_last_error() gives the reason (thread-local, valid until this
 *   thread's next pinfeed call). No C++ exception crosses this boundary.
 * - Handles are opaque. A batch keeps its loader alive: destroying a loader
 *   while batches are out is allowed; the loader goes when the last of them
 *   is released.
 * - Strings returned through char** are owned by the caller: free them with
 *   pinfeed_free_string().
 * - Thread-safety: one loader is driven by one thread at a time; batches may
 *   be released from any thread.
 */
#ifndef PINFEED_PINFEED_H
#define PINFEED_PINFEED_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define PINFEED_API __declspec(dllexport)
#else
#define PINFEED_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum pinfeed_status {
  PINFEED_OK = 0,
  PINFEED_END = 1,             /* pinfeed_loader_next: the epoch is over (not an error) */
  PINFEED_ERROR_CONFIG = 2,    /* a bad argument or configuration (the message names it) */
  PINFEED_ERROR_DATA = 3,      /* a file could not be read or decoded (the message names it) */
  PINFEED_ERROR_MEMORY = 4,    /* memory could not be provided */
  PINFEED_ERROR_CANCELLED = 5, /* a wait was cancelled */
  PINFEED_ERROR = 6            /* anything else */
} pinfeed_status;

typedef struct pinfeed_loader pinfeed_loader;
typedef struct pinfeed_batch pinfeed_batch;

/* Loader options by name: every option of the loader's table (the Python
 * keywords: "batch_size", "crop", "flip_p", "interpolation", "height",
 * "pressure_floor", ...) and the fields outside it: "dataset", "list_root",
 * "rank", "world_size", "mean" and "std" ("0.485,0.456,0.406"), "cache_dir"
 * (shards given as http://, https://, s3:// or pipe: URLs). Values are
 * text, parsed and range-checked by the same table as the CLI and Python:
 * "64", "0.5", "true"/"false"/"1"/"0", a choice word. An option added to
 * the table reaches C with no change here. pinfeed_options_list_json() lists
 * them all: name, type, default, range, help.
 *
 *   pinfeed_options* o;  pinfeed_options_create(&o);
 *   pinfeed_options_set(o, "dataset", "/data/train");
 *   pinfeed_options_set(o, "batch_size", "256");
 *   pinfeed_loader_create_from_options(o, &loader);  pinfeed_options_destroy(o);
 */
typedef struct pinfeed_options pinfeed_options;

/* The older fixed struct, kept for existing callers (it reaches only the
 * fields below; new code uses pinfeed_options). Initialize with
 * pinfeed_loader_config_init() (every field gets the C++ LoaderConfig's
 * default), then set fields. */
typedef struct pinfeed_loader_config {
  const char* dataset;       /* folder (ImageFolder), file list, or tar shard pattern; required */
  const char* list_root;     /* root of a file list's relative paths; NULL: the list's folder */
  size_t batch_size;         /* 64 */
  unsigned threads;          /* 0: the cores divided by the ranks on this host */
  size_t prefetch;           /* batches in flight = pool slots; 4 */
  unsigned rank, world_size; /* this process's shard; 0 of 1 */
  int shuffle;               /* 1 */
  int drop_last;             /* sampler: trim instead of padding; 0 */
  int drop_last_batch;       /* drop a final partial batch; 0 */
  uint64_t seed;             /* 0 */
  const char* crop;          /* "random" (RandomResizedCrop), "center" (Resize + CenterCrop), "full" */
  int size;                  /* output side; 224 */
  int resize;                /* center crop: shorter side before cropping; 256 */
  int flip;                  /* random horizontal flip (random crop only); 1 */
  const char* layout;        /* "nchw-f32" (normalized float32) or "nhwc-u8" */
  float mean[3], std[3];     /* normalization, RGB */
  const char* bad_sample;    /* "replace" or "fail" */
  int pin;                   /* 1: pin the pool within the budget; 0: pageable */
  int watch_pressure; /* 1: under critical memory pressure give slots beyond a floor of 2 back to the kernel, re-pin
                         after */
} pinfeed_loader_config;

/* A batch's contents; pointers are valid until pinfeed_batch_release(). */
typedef struct pinfeed_batch_view {
  void* data; /* size * sample_bytes bytes in `layout` */
  size_t bytes;
  size_t size; /* samples (batch_size, or fewer in a final partial batch) */
  size_t sample_bytes;
  int64_t shape[4];      /* N, C, H, W for nchw-f32; N, H, W, C for nhwc-u8 */
  const char* dtype;     /* "float32" or "uint8" */
  const char* layout;    /* "nchw-f32" or "nhwc-u8" */
  const int64_t* labels; /* size of them */
  const size_t* indices; /* dataset index of each sample */
  int pinned;            /* 1: page-locked memory */
  uint64_t epoch;
  size_t index;    /* batch number in this epoch's run */
  size_t position; /* epoch position of the first sample */
} pinfeed_batch_view;

typedef struct pinfeed_loader_state {
  uint64_t seed, epoch, position; /* position: samples of this rank's epoch delivered */
  unsigned world_size, rank;
} pinfeed_loader_state;

PINFEED_API const char* pinfeed_version(void);
PINFEED_API const char* pinfeed_last_error(void);
PINFEED_API void pinfeed_free_string(char* s);

/* Every option at its default. */
PINFEED_API pinfeed_status pinfeed_options_create(pinfeed_options** out);
PINFEED_API void pinfeed_options_destroy(pinfeed_options* options);
/* PINFEED_ERROR_CONFIG naming the option and its range for an unknown name or a bad value
   (the options keep their previous value). */
PINFEED_API pinfeed_status pinfeed_options_set(pinfeed_options* options, const char* name, const char* value);
PINFEED_API pinfeed_status pinfeed_options_get(const pinfeed_options* options, const char* name, char** value_out);
/* [{"name", "type" (integer, real, boolean, choice, text, rgb), "default", "range", "help"}, ...] */
PINFEED_API pinfeed_status pinfeed_options_list_json(char** json_out);
PINFEED_API pinfeed_status pinfeed_loader_create_from_options(const pinfeed_options* options, pinfeed_loader** out);
/* An option's value in the loader's configuration, as it was made. */
PINFEED_API pinfeed_status pinfeed_loader_get_option(const pinfeed_loader* loader, const char* name, char** value_out);

PINFEED_API void pinfeed_loader_config_init(pinfeed_loader_config* config);
PINFEED_API pinfeed_status pinfeed_loader_create(const pinfeed_loader_config* config, pinfeed_loader** out);
PINFEED_API void pinfeed_loader_destroy(pinfeed_loader* loader);
PINFEED_API pinfeed_status pinfeed_loader_begin_epoch(pinfeed_loader* loader, uint64_t epoch);
/* PINFEED_OK with *out set, PINFEED_END at the end of the epoch, or an error. */
PINFEED_API pinfeed_status pinfeed_loader_next(pinfeed_loader* loader, pinfeed_batch** out);
PINFEED_API size_t pinfeed_loader_batches_per_epoch(const pinfeed_loader* loader);
PINFEED_API size_t pinfeed_loader_num_classes(const pinfeed_loader* loader);
PINFEED_API pinfeed_status pinfeed_loader_get_state(const pinfeed_loader* loader, pinfeed_loader_state* out);
PINFEED_API pinfeed_status pinfeed_loader_restore(pinfeed_loader* loader, const pinfeed_loader_state* state);
/* Stats of the current epoch as JSON (images/s, stage times, pool, ...); "pool" has
   live_slots, released_slots, given_back_bytes, last_release_seconds (memory pressure). */
PINFEED_API pinfeed_status pinfeed_loader_stats_json(const pinfeed_loader* loader, char** json_out);

PINFEED_API pinfeed_status pinfeed_batch_get_view(const pinfeed_batch* batch, pinfeed_batch_view* out);
PINFEED_API void pinfeed_batch_release(pinfeed_batch* batch);

/* The diagnostics report of `pinfeed-diag --json`: root NULL means "/";
 * batch_shape (e.g. "256x3x224x224:u8") NULL or "" means no pool plan. */
PINFEED_API pinfeed_status pinfeed_diag_json(const char* root, unsigned gpus, const char* batch_shape,
                                             unsigned prefetch, char** json_out);

#ifdef __cplusplus
}
#endif

#endif /* PINFEED_PINFEED_H */

/* The C ABI from C: a real C translation unit (so pinfeed.h must be valid C),
 * run by ctest with a dataset folder as argv[1]. Checks a full epoch, the
 * view of a batch, state and restore, stats, diagnostics, and that every
 * error comes back as a status and a message — never as a crash. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pinfeed/pinfeed.h"

static int failures = 0;
#define CHECK(cond)                                                                                                  \
  do {                                                                                                               \
    if (!(cond)) {                                                                                                   \
      fprintf(stderr, "%s:%d: CHECK(%s) failed; last error: %s\n", __FILE__, __LINE__, #cond, pinfeed_last_error()); \
      ++failures;                                                                                                    \
    }                                                                                                                \
  } while (0)

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: capi_test DATASET_DIR\n");
    return 2;
  }
  pinfeed_loader_config cfg;
  pinfeed_loader_config_init(&cfg);
  CHECK(cfg.batch_size == 64 && cfg.size == 224 && cfg.shuffle == 1);

  /* Errors: a status and a message naming the problem. */
  pinfeed_loader* loader = NULL;
  CHECK(pinfeed_loader_create(&cfg, &loader) == PINFEED_ERROR_CONFIG && loader == NULL);
  CHECK(strstr(pinfeed_last_error(), "dataset") != NULL);
  cfg.dataset = "/nonexistent/pinfeed";
  CHECK(pinfeed_loader_create(&cfg, &loader) == PINFEED_ERROR_DATA);
  CHECK(strstr(pinfeed_last_error(), "/nonexistent/pinfeed") != NULL);
  cfg.dataset = argv[1];
  cfg.crop = "diagonal";
  CHECK(pinfeed_loader_create(&cfg, &loader) == PINFEED_ERROR_CONFIG);
  CHECK(strstr(pinfeed_last_error(), "diagonal") != NULL);
  CHECK(pinfeed_loader_next(NULL, NULL) == PINFEED_ERROR_CONFIG);

  /* A full epoch. */
  cfg.crop = "center";
  cfg.size = 32;
  cfg.batch_size = 5;
  cfg.layout = "nhwc-u8";
  cfg.watch_pressure = 0;
  CHECK(pinfeed_loader_create(&cfg, &loader) == PINFEED_OK);
  if (loader == NULL) return 1;
  const size_t batches = pinfeed_loader_batches_per_epoch(loader);
  CHECK(batches > 0);
  CHECK(pinfeed_loader_num_classes(loader) >= 2);
  CHECK(pinfeed_loader_begin_epoch(loader, 0) == PINFEED_OK);
  size_t seen = 0, samples = 0;
  size_t first_index = 0;
  for (;;) {
    pinfeed_batch* b = NULL;
    const pinfeed_status st = pinfeed_loader_next(loader, &b);
    if (st == PINFEED_END) break;
    CHECK(st == PINFEED_OK);
    if (st != PINFEED_OK) break;
    pinfeed_batch_view v;
    CHECK(pinfeed_batch_get_view(b, &v) == PINFEED_OK);
    CHECK(strcmp(v.dtype, "uint8") == 0 && strcmp(v.layout, "nhwc-u8") == 0);
    CHECK(v.shape[0] == (int64_t)v.size && v.shape[1] == 32 && v.shape[2] == 32 && v.shape[3] == 3);
    CHECK(v.bytes == v.size * 32 * 32 * 3);
    CHECK(v.labels[0] >= 0);
    if (seen == 1) first_index = v.indices[0];
    samples += v.size;
    ++seen;
    pinfeed_batch_release(b);
  }
  CHECK(seen == batches);

  /* State and restore: after two batches of epoch 1, restoring gives the
   * third batch again. */
  CHECK(pinfeed_loader_begin_epoch(loader, 1) == PINFEED_OK);
  pinfeed_batch* b = NULL;
  CHECK(pinfeed_loader_next(loader, &b) == PINFEED_OK);
  pinfeed_batch_release(b);
  pinfeed_loader_state state;
  CHECK(pinfeed_loader_get_state(loader, &state) == PINFEED_OK);
  CHECK(state.epoch == 1 && state.position == 5);
  CHECK(pinfeed_loader_next(loader, &b) == PINFEED_OK);
  pinfeed_batch_view v1;
  pinfeed_batch_get_view(b, &v1);
  const size_t second_index = v1.indices[0];
  pinfeed_batch_release(b);
  CHECK(pinfeed_loader_restore(loader, &state) == PINFEED_OK);
  CHECK(pinfeed_loader_next(loader, &b) == PINFEED_OK);
  pinfeed_batch_get_view(b, &v1);
  CHECK(v1.indices[0] == second_index);

  /* A batch may outlive its loader handle. */
  pinfeed_loader_destroy(loader);
  CHECK(v1.size == 5);
  pinfeed_batch_release(b);
  (void)first_index;
  (void)samples;

  /* Stats and diagnostics as JSON. */
  CHECK(pinfeed_loader_create(&cfg, &loader) == PINFEED_OK);
  char* json = NULL;
  CHECK(pinfeed_loader_stats_json(loader, &json) == PINFEED_OK && json != NULL && strstr(json, "\"pool\"") != NULL);
  /* What memory pressure did to the pool: live and released slots, bytes given back. */
  CHECK(strstr(json, "\"live_slots\"") != NULL && strstr(json, "\"released_slots\"") != NULL &&
        strstr(json, "\"given_back_bytes\"") != NULL && strstr(json, "\"last_release_seconds\"") != NULL);
  pinfeed_free_string(json);
  pinfeed_loader_destroy(loader);
  CHECK(pinfeed_diag_json(NULL, 1, "8x3x32x32:u8", 2, &json) == PINFEED_OK);
  CHECK(json != NULL && strstr(json, "\"verdict\"") != NULL);
  pinfeed_free_string(json);
  CHECK(pinfeed_diag_json(NULL, 1, "8xZx32:u8", 2, &json) == PINFEED_ERROR_CONFIG);

  /* Options by name: what the fixed struct never reached (height, flip_p,
   * interpolation, pressure_floor), parsed and checked by the option table,
   * and read back from the loader made with them. */
  pinfeed_options* o = NULL;
  CHECK(pinfeed_options_create(&o) == PINFEED_OK && o != NULL);
  CHECK(pinfeed_loader_create_from_options(o, &loader) == PINFEED_ERROR_CONFIG && loader == NULL);
  CHECK(strstr(pinfeed_last_error(), "dataset") != NULL);
  CHECK(pinfeed_options_set(o, "dataset", argv[1]) == PINFEED_OK);
  CHECK(pinfeed_options_set(o, "batch_size", "4") == PINFEED_OK);
  CHECK(pinfeed_options_set(o, "size", "40") == PINFEED_OK);
  CHECK(pinfeed_options_set(o, "height", "24") == PINFEED_OK);
  CHECK(pinfeed_options_set(o, "flip_p", "0.25") == PINFEED_OK);
  CHECK(pinfeed_options_set(o, "interpolation", "nearest") == PINFEED_OK);
  CHECK(pinfeed_options_set(o, "pressure_floor", "3") == PINFEED_OK);
  CHECK(pinfeed_options_set(o, "mean", "0.5,0.5,0.5") == PINFEED_OK);
  CHECK(pinfeed_options_set(o, "watch_pressure", "false") == PINFEED_OK);
  /* Refused values name the option and its range, and change nothing. */
  CHECK(pinfeed_options_set(o, "batch_size", "0") == PINFEED_ERROR_CONFIG);
  CHECK(strstr(pinfeed_last_error(), "batch_size") != NULL && strstr(pinfeed_last_error(), "1..") != NULL);
  CHECK(pinfeed_options_set(o, "interpolation", "cubic-ish") == PINFEED_ERROR_CONFIG);
  CHECK(strstr(pinfeed_last_error(), "nearest") != NULL);
  CHECK(pinfeed_options_set(o, "no_such_option", "1") == PINFEED_ERROR_CONFIG);
  CHECK(strstr(pinfeed_last_error(), "no_such_option") != NULL);
  CHECK(pinfeed_options_set(o, "std", "1,2") == PINFEED_ERROR_CONFIG);
  CHECK(pinfeed_options_set(NULL, "size", "1") == PINFEED_ERROR_CONFIG);
  char* text = NULL;
  CHECK(pinfeed_options_get(o, "batch_size", &text) == PINFEED_OK && strcmp(text, "4") == 0);
  pinfeed_free_string(text);
  CHECK(pinfeed_options_get(o, "interpolation", &text) == PINFEED_OK && strcmp(text, "nearest") == 0);
  pinfeed_free_string(text);
  CHECK(pinfeed_loader_create_from_options(o, &loader) == PINFEED_OK && loader != NULL);
  pinfeed_options_destroy(o);
  if (loader == NULL) return 1;
  CHECK(pinfeed_loader_get_option(loader, "flip_p", &text) == PINFEED_OK && strcmp(text, "0.25") == 0);
  pinfeed_free_string(text);
  CHECK(pinfeed_loader_get_option(loader, "pressure_floor", &text) == PINFEED_OK && strcmp(text, "3") == 0);
  pinfeed_free_string(text);
  CHECK(pinfeed_loader_get_option(loader, "mean", &text) == PINFEED_OK && strcmp(text, "0.5,0.5,0.5") == 0);
  pinfeed_free_string(text);
  CHECK(pinfeed_loader_begin_epoch(loader, 0) == PINFEED_OK);
  CHECK(pinfeed_loader_next(loader, &b) == PINFEED_OK);
  CHECK(pinfeed_batch_get_view(b, &v1) == PINFEED_OK);
  CHECK(v1.shape[0] == 4 && v1.shape[1] == 3 && v1.shape[2] == 24 && v1.shape[3] == 40); /* height x size */
  pinfeed_batch_release(b);
  pinfeed_loader_destroy(loader);
  CHECK(pinfeed_options_list_json(&json) == PINFEED_OK && strstr(json, "\"pressure_floor\"") != NULL &&
        strstr(json, "\"dataset\"") != NULL);
  pinfeed_free_string(json);

  if (failures == 0) printf("capi_test: all checks passed (%zu batches)\n", seen);
  return failures == 0 ? 0 : 1;
}

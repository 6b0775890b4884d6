/* Shared by paged_decode.c and paged_flash.c: checking one sequence of a varlen batch before it
 * is read (batch_seq_ok), and the last step of split-KV attention: merge each query row's
 * partial states from the KV splits by log-sum-exp into out and lse.
 *
 * states holds num_splits blocks of split_floats floats; in block s, for row at (at = kvh * rows
 * + r, r = i * group + g being query token i, head kvh * group + g): the running max m at
 * [at], the sum l at [all_rows + at] and the unnormalised output row at [2 * all_rows + at * d].
 * A split that saw no key for the row has m = -inf. log2_units: m is in log2 units (scores
 * pre-scaled by log2 e), else natural ones. out [L, H, d], lse [L, H] in natural log; a row
 * that saw nothing gets out 0 and lse -inf.
 */
#ifndef LONGCTX_SPLIT_MERGE_H
#define LONGCTX_SPLIT_MERGE_H

#include <math.h>
#include <stdint.h>

/* Whether sequence s of a batch reads only memory it owns: a row of the table (table_rows
 * rows of table_stride ids), query rows cu_q[s] .. cu_q[s + 1] inside q's total_q, and block
 * ids of its ctx_lens[s] tokens inside the cache's num_blocks. The caller's checks come first;
 * this one keeps a bad table from reading outside the cache. */
static inline int batch_seq_ok(int s, int table_rows, const int32_t *block_table, int64_t table_stride,
                               int num_blocks, int block_size, const int32_t *ctx_lens, const int32_t *cu_q,
                               int total_q) {
    if (s < 0 || s >= table_rows || cu_q[s] < 0 || cu_q[s + 1] < cu_q[s] || cu_q[s + 1] > total_q) return 0;
    if (ctx_lens[s] < 0) return 0;
    const int64_t needed = ((int64_t)ctx_lens[s] + block_size - 1) / block_size;
    if (needed > table_stride) return 0;
    const int32_t *row = block_table + (int64_t)s * table_stride;
    for (int64_t b = 0; b < needed; b++)
        if (row[b] < 0 || row[b] >= num_blocks) return 0;
    return 1;
}

/* The first key any new token of a sequence may see: 0, or with a sliding window the first
 * one inside the window of its first new token (every new token sits at or past first_new). */
static inline int key_start(int ctx_len, int q_len, int window) {
    const int lo = ctx_len - q_len - window + 1;
    return window > 0 && lo > 0 ? lo : 0;
}

/* Merge one row (at) of the states into out / lse. */
static void merge_row(const float *states, int num_splits, int64_t split_floats, int all_rows, int at,
                      int rows, int group, int num_heads, int d, int log2_units, float *out, float *lse) {
    const int kvh = at / rows, r = at % rows;
    const int i = r / group, hq = kvh * group + r % group;
    float peak = -INFINITY;
    for (int s = 0; s < num_splits; s++) {
        const float ms = states[s * split_floats + at];
        peak = ms > peak ? ms : peak;
    }
    float *o = out + ((int64_t)i * num_heads + hq) * d;
    for (int x = 0; x < d; x++) o[x] = 0.0f;
    float total = 0.0f;
    for (int s = 0; s < num_splits; s++) {
        const float *state = states + s * split_floats;
        if (state[at] == -INFINITY) continue;
        const float w = log2_units ? exp2f(state[at] - peak) : expf(state[at] - peak);
        total += w * state[all_rows + at];
        const float *acc = state + 2 * all_rows + (int64_t)at * d;
        for (int x = 0; x < d; x++) o[x] += w * acc[x];
    }
    if (total > 0.0f) {
        const float inv = 1.0f / total;
        for (int x = 0; x < d; x++) o[x] *= inv;
        lse[i * num_heads + hq] = log2_units ? (peak + log2f(total)) * 0.693147180559945309f
                                             : peak + logf(total);
    } else {
        lse[i * num_heads + hq] = -INFINITY;
    }
}

/* Every row of one sequence's states, over `threads` OpenMP threads. */
static inline void merge_splits(const float *states, int num_splits, int64_t split_floats, int all_rows,
                         int rows, int group, int num_heads, int d, int log2_units, float *out,
                         float *lse, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int at = 0; at < all_rows; at++)
        merge_row(states, num_splits, split_floats, all_rows, at, rows, group, num_heads, d, log2_units, out, lse);
}

#endif

// What the batch-invariance programs of this folder share: a seeded generator, the CPU backend's extra buffer
// types, a weight in a buffer, one matrix product through ggml's graph API, and dequantization of the activations'
// formats (q8_1, q8_K) that ggml has no to_float for, and the check itself (check_rows). Included by
// repack_invariance.c and amx_invariance.c.
#pragma once

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_state;

static float uniform(void) {  // [-1, 1), xorshift64*
    rng_state ^= rng_state >> 12; rng_state ^= rng_state << 25; rng_state ^= rng_state >> 27;
    return (float) ((rng_state * 2685821657736338717ULL) >> 40) / (float) (1 << 23) - 1.0f;
}

// the CPU backend's extra buffer type called `name` ("CPU_REPACK", "AMX"), or NULL
static ggml_backend_buffer_type_t extra_buffer_type(const char * name) {
    ggml_backend_reg_t reg = ggml_backend_cpu_reg();
    ggml_backend_dev_t dev = ggml_backend_reg_dev_get(reg, 0);
    ggml_backend_dev_get_extra_bufts_t get =
        (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    for (ggml_backend_buffer_type_t * b = get ? get(dev) : NULL; b && *b; b++) {
        if (strcmp(ggml_backend_buft_name(*b), name) == 0) {
            return *b;
        }
    }
    return NULL;
}

// w (in its buffer) times the first m rows of x; the result, m rows of nc floats, into out
static void matmul(ggml_backend_t backend, struct ggml_tensor * w, const float * x, int n, int m, float * out) {
    struct ggml_init_params params = { ggml_tensor_overhead() * 8 + ggml_graph_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(params);
    struct ggml_tensor * xt = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n, m);
    struct ggml_tensor * y = ggml_mul_mat(ctx, w, xt);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    ggml_backend_tensor_set(xt, x, 0, ggml_nbytes(xt));
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
        fprintf(stderr, "graph compute failed\n");
        exit(3);
    }
    ggml_backend_tensor_get(y, out, 0, ggml_nbytes(y));
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
}

// an empty weight tensor of `type` in a buffer of `buft` (its context and buffer are returned too)
static struct ggml_tensor * weight(ggml_backend_buffer_type_t buft, enum ggml_type type, int n, int nc,
                                   struct ggml_context ** ctx_out, ggml_backend_buffer_t * buf_out) {
    struct ggml_init_params params = { ggml_tensor_overhead() * 2, NULL, true };
    struct ggml_context * ctx = ggml_init(params);
    struct ggml_tensor * w = ggml_new_tensor_2d(ctx, type, n, nc);
    *buf_out = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    *ctx_out = ctx;
    return w;
}

// the values of int8 blocks (a scale first, fp16 or float, the int8 values from byte 4) as floats
static void int8_blocks_to_float(const void * src, float * dst, int64_t count, int values, size_t block_bytes,
                                 int fp16_scale) {
    for (int64_t b = 0; b < count / values; b++) {
        const char * block = (const char *) src + b * block_bytes;
        float d;
        if (fp16_scale) {
            ggml_fp16_t d16;
            memcpy(&d16, block, sizeof d16);
            d = ggml_fp16_to_fp32(d16);
        } else {
            memcpy(&d, block, sizeof d);
        }
        for (int i = 0; i < values; i++) dst[b * values + i] = d * (float) ((const int8_t *) (block + 4))[i];
    }
}

// to floats; q8_1 (the activations of q4_1) and q8_K (of the K-quants) have no ggml to_float:
// q8_1's block is an fp16 d, an fp16 s and 32 int8 values (36 bytes); q8_K's a float d, 256 int8 values and
// 16 int16 sums (292 bytes)
static void dequantize(enum ggml_type type, const void * src, float * dst, int64_t count) {
    const size_t expected = type == GGML_TYPE_Q8_1 ? 36 : type == GGML_TYPE_Q8_K ? 292 : 0;
    if (expected == 0) {
        ggml_get_type_traits(type)->to_float(src, dst, count);
        return;
    }
    if (ggml_type_size(type) != expected) {
        fprintf(stderr, "unexpected %s block size %zu\n", ggml_type_name(type), ggml_type_size(type));
        exit(3);
    }
    if (type == GGML_TYPE_Q8_1) int8_blocks_to_float(src, dst, count, 32, expected, 1);
    else int8_blocks_to_float(src, dst, count, 256, expected, 0);
}

// a weight of nc rows x n columns quantized to `type` from random values, a few scaled up so that the per-block
// scales vary (malloc'd; its size in *qsize)
static void * random_quantized_weight(enum ggml_type type, int n, int nc, size_t * qsize) {
    float * wf = malloc(sizeof(float) * (size_t) n * nc);
    for (size_t i = 0; i < (size_t) n * nc; i++) wf[i] = uniform() * (i % 97 == 0 ? 4.0f : 1.0f);
    *qsize = ggml_row_size(type, n) * nc;
    void * q = malloc(*qsize);
    ggml_quantize_chunk(type, wf, q, 0, nc, n, NULL);
    free(wf);
    return q;
}

// w (in its buffer, holding the quantized values q of `type`) times M = 1..max_rows random activation rows. Prints
// per M "width M rows_differing R max_abs_diff D" (rows of the M-row product that are not bitwise the row computed
// alone), then "reference_max_rel_diff X": the largest difference of the max_rows-row product from a
// double-precision product of the dequantized weight and the activations as the kernels quantize them (to the
// type's vec_dot type; f16 weights take float activations), relative to the largest product: a sanity check that
// the kernels compute the product. Returns 1 if some row differs, else 0.
static int check_rows(ggml_backend_t backend, struct ggml_tensor * w, enum ggml_type type, const void * q, int n,
                      int nc, int max_rows) {
    // activations: random, with some large values (as hidden states have)
    float * x = malloc(sizeof(float) * (size_t) n * max_rows);
    for (size_t i = 0; i < (size_t) n * max_rows; i++) x[i] = uniform() * (i % 61 == 0 ? 8.0f : 1.0f);

    float * single = malloc(sizeof(float) * (size_t) nc * max_rows);   // row r computed alone
    for (int r = 0; r < max_rows; r++) matmul(backend, w, x + (size_t) r * n, n, 1, single + (size_t) r * nc);

    float * got = malloc(sizeof(float) * (size_t) nc * max_rows);
    int bad = 0;
    for (int m = 1; m <= max_rows; m++) {
        matmul(backend, w, x, n, m, got);
        int rows = 0;
        double worst = 0.0;
        for (int r = 0; r < m; r++) {
            const float * a = got + (size_t) r * nc, * b = single + (size_t) r * nc;
            if (memcmp(a, b, sizeof(float) * nc) != 0) rows++;
            for (int j = 0; j < nc; j++) worst = fmax(worst, fabs((double) a[j] - b[j]));
        }
        printf("width %d rows_differing %d max_abs_diff %.9g\n", m, rows, worst);
        bad |= rows != 0;
    }

    const enum ggml_type act_type =
        type == GGML_TYPE_F16 ? GGML_TYPE_F32 : ggml_get_type_traits_cpu(type)->vec_dot_type;
    float * wd = malloc(sizeof(float) * (size_t) n * nc);
    float * xd = malloc(sizeof(float) * (size_t) n * max_rows);
    void * xq = malloc(ggml_row_size(act_type, n) * max_rows);
    ggml_get_type_traits(type)->to_float(q, wd, (int64_t) n * nc);
    if (act_type == GGML_TYPE_F32) {
        memcpy(xd, x, sizeof(float) * (size_t) n * max_rows);
    } else {
        for (int r = 0; r < max_rows; r++) {      // as the kernels quantize activations, row by row
            ggml_get_type_traits_cpu(act_type)->from_float(x + (size_t) r * n,
                                                           (char *) xq + ggml_row_size(act_type, n) * r, n);
        }
        dequantize(act_type, xq, xd, (int64_t) n * max_rows);
    }
    double rel = 0.0, scale = 0.0;
    for (int r = 0; r < max_rows; r++) {
        for (int j = 0; j < nc; j++) {
            double ref = 0.0;
            for (int i = 0; i < n; i++) ref += (double) wd[(size_t) j * n + i] * xd[(size_t) r * n + i];
            scale = fmax(scale, fabs(ref));
            rel = fmax(rel, fabs(ref - got[(size_t) r * nc + j]));
        }
    }
    printf("reference_max_rel_diff %.3g\n", scale > 0 ? rel / scale : 0.0);
    free(wd); free(xd); free(xq); free(x); free(single); free(got);
    return bad;
}

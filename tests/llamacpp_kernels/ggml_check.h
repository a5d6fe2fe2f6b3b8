// What the batch-invariance programs of this folder share: a seeded generator, the CPU backend's extra buffer
// types, a weight in a buffer, one matrix product through ggml's graph API, and dequantization of the activations'
// formats (q8_1, q8_K) that ggml has no to_float for. Included by repack_invariance.c and amx_invariance.c.
#pragma once

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

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

// to floats; q8_1 (the activations of q4_1) and q8_K (of the K-quants) have no ggml to_float:
// q8_1's block is an fp16 d, an fp16 s and 32 int8 values (36 bytes); q8_K's a float d, 256 int8 values and
// 16 int16 sums (292 bytes)
static void dequantize(enum ggml_type type, const void * src, float * dst, int64_t count) {
    if (type == GGML_TYPE_Q8_1) {
        if (ggml_type_size(type) != 36) {
            fprintf(stderr, "unexpected q8_1 block size %zu\n", ggml_type_size(type));
            exit(3);
        }
        for (int64_t b = 0; b < count / 32; b++) {
            const char * block = (const char *) src + b * 36;
            ggml_fp16_t d16;
            memcpy(&d16, block, sizeof d16);
            const float d = ggml_fp16_to_fp32(d16);
            for (int i = 0; i < 32; i++) dst[b * 32 + i] = d * (float) ((const int8_t *) (block + 4))[i];
        }
        return;
    }
    if (type != GGML_TYPE_Q8_K) {
        ggml_get_type_traits(type)->to_float(src, dst, count);
        return;
    }
    if (ggml_type_size(type) != 292) {
        fprintf(stderr, "unexpected q8_K block size %zu\n", ggml_type_size(type));
        exit(3);
    }
    for (int64_t b = 0; b < count / 256; b++) {
        const char * block = (const char *) src + b * 292;
        float d;
        memcpy(&d, block, sizeof d);
        for (int i = 0; i < 256; i++) dst[b * 256 + i] = d * (float) ((const int8_t *) (block + 4))[i];
    }
}

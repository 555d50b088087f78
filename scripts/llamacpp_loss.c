// llama.cpp's own mean next-token loss of a base GGUF, with or without a LoRA GGUF, on rows of
// token ids: the number `mesp eval --json` prints as "loss" for the same rows (every next token
// of each row: its NLL given the tokens before it, summed over all rows, divided by their count).
// Built and run by scripts/llamacpp-loss against llama.cpp's C API (include/llama.h).
//
//   llamacpp_loss BASE.gguf ADAPTER.gguf|- IDS.txt [THREADS]
//
// IDS.txt: one row per line, token ids separated by spaces (no BOS is added). Prints one JSON
// object: {"loss": L, "tokens": N, "rows": R, "adapter": true|false}. The K/V cache is F32 (the
// default F16 would round what mesp keeps in float32).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static void quiet(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static int fail(const char *what) {
    fprintf(stderr, "llamacpp_loss: %s\n", what);
    return 2;
}

// One row of ids from `line` into `ids` (grown as needed); returns its length. A row may end in
// "| m0 m1 ...": a 0/1 per id (mesp's loss_mask), and then only targets i with mask 1 are scored;
// the mask's text is left in *mask_text (NULL when there is none).
static int parse_row(char *line, llama_token **ids, int *cap, char **mask_text) {
    int n = 0;
    char *bar = strchr(line, '|');
    *mask_text = bar ? bar + 1 : NULL;
    if (bar) *bar = '\0';
    for (char *tok = strtok(line, " \t\r\n"); tok != NULL; tok = strtok(NULL, " \t\r\n")) {
        if (n == *cap) {
            *cap = *cap ? 2 * *cap : 256;
            *ids = realloc(*ids, (size_t)*cap * sizeof(llama_token));
        }
        (*ids)[n++] = (llama_token)strtol(tok, NULL, 10);
    }
    return n;
}

int main(int argc, char **argv) {
    if (argc < 4) return fail("usage: llamacpp_loss BASE.gguf ADAPTER.gguf|- IDS.txt [THREADS]");
    const char *adapter_path = strcmp(argv[2], "-") == 0 ? NULL : argv[2];
    const int threads = argc > 4 ? atoi(argv[4]) : 1;
    FILE *rows = fopen(argv[3], "r");
    if (rows == NULL) return fail("cannot open the ids file");

    // the longest row sizes the context and the batch: one decode per row, logits everywhere
    char *line = NULL;
    size_t line_cap = 0;
    llama_token *ids = NULL;
    int ids_cap = 0, longest = 0;
    char *mask_text = NULL;
    while (getline(&line, &line_cap, rows) > 0) {
        int n = parse_row(line, &ids, &ids_cap, &mask_text);
        if (n > longest) longest = n;
    }
    if (longest < 2) return fail("no row of two or more tokens");

    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (model == NULL) return fail("llama.cpp could not load the base model");
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = (uint32_t)longest;
    cp.n_seq_max = 1;
    cp.n_threads = cp.n_threads_batch = threads;
    cp.type_k = cp.type_v = GGML_TYPE_F32;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (ctx == NULL) return fail("llama.cpp could not make a context");
    if (adapter_path != NULL) {
        struct llama_adapter_lora *lora = llama_adapter_lora_init(model, adapter_path);
        if (lora == NULL) return fail("llama.cpp could not load the adapter");
        float scale = 1.0f;  // llama.cpp applies alpha / rank on top, as PEFT does
        if (llama_set_adapters_lora(ctx, &lora, 1, &scale) != 0)
            return fail("llama.cpp could not set the adapter");
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    struct llama_batch batch = llama_batch_init(longest, 0, 1);
    double total = 0.0;
    long tokens = 0, n_rows = 0;
    rewind(rows);
    char *mask = NULL;
    while (getline(&line, &line_cap, rows) > 0) {
        int n = parse_row(line, &ids, &ids_cap, &mask_text);
        if (n == 0) continue;  // a blank line
        mask = realloc(mask, (size_t)n);
        int n_mask = 0;
        for (char *t = mask_text ? strtok(mask_text, " \t\r\n") : NULL; t && n_mask < n;
             t = strtok(NULL, " \t\r\n"))
            mask[n_mask++] = (char)(t[0] == '1');
        if (mask_text != NULL && n_mask != n) return fail("a row's mask and ids differ in length");
        if (mask_text == NULL) memset(mask, 1, (size_t)n);
        if (n < 2) return fail("a row of one token has no next token");
        for (int i = 0; i < n; ++i) {
            if (ids[i] < 0 || ids[i] >= n_vocab) return fail("a token id outside the vocabulary");
            batch.token[i] = ids[i];
            batch.pos[i] = i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = i + 1 < n;  // every position that has a next token
        }
        batch.n_tokens = n;
        llama_memory_clear(llama_get_memory(ctx), true);
        if (llama_decode(ctx, batch) != 0) return fail("llama_decode failed");
        for (int i = 0; i + 1 < n; ++i) {
            if (!mask[i + 1]) continue;  // not a trained target (mesp eval skips it too)
            const float *z = llama_get_logits_ith(ctx, i);
            double m = z[0], s = 0.0;
            for (int v = 1; v < n_vocab; ++v) m = z[v] > m ? z[v] : m;
            for (int v = 0; v < n_vocab; ++v) s += exp((double)z[v] - m);
            total += m + log(s) - (double)z[ids[i + 1]];
            ++tokens;
        }
        ++n_rows;
    }
    printf("{\"loss\": %.9f, \"tokens\": %ld, \"rows\": %ld, \"adapter\": %s}\n",
           total / (double)tokens, tokens, n_rows, adapter_path ? "true" : "false");
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    free(ids);
    free(mask);
    free(line);
    fclose(rows);
    return 0;
}
